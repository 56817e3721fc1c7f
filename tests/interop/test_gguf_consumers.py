"""Proof by the real consumers: gguf-py's GGUFReader and transformers'
`from_pretrained(dir, gguf_file=...)` load the GGUF files qtool writes from a float GGUF of a
tiny llama (tests/gguf_models.py), and the weights they load are exactly qtool's
dequantization (mapped to Hugging Face names and layout by formats/gguf/names.py); the
tokenizer loads too. With llama-cpp-python installed, llama.cpp itself loads them and
generates (skipped otherwise: it compiles llama.cpp from source)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qtool.formats.gguf import plan
from qtool.formats.gguf.names import HFView, hf_view, pair_names
from qtool.formats.gguf.reader import GGUFFloatReader
from qtool.formats.gguf.writer import write_quantized
from qtool.io.atomic import OutputSet
from qtool.io.gguf_file import GGUFFile
from qtool.spec import gguf_spec
from tests import gguf_models as M
from tests.conftest import Invoke

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = M.make_hf_llama(tmp_path_factory.mktemp("tiny"))
    M.write_float_gguf(d, d / "f16.gguf", "F16")
    return d


def _write(src: Path, out: Path, qtype: str) -> None:
    with GGUFFile(src) as f, OutputSet() as outputs:
        choices = plan.choose(f.header.tensors, lambda info: gguf_spec(qtype), "llama")
        write_quantized(f, choices, out, outputs)
        outputs.commit()


@pytest.mark.parametrize("qtype", TYPES)
def test_gguf_py_and_transformers_load_qtools_files_as_qtool_dequantizes(
    tiny: Path, qtype: str
) -> None:
    out = tiny / f"tiny-{qtype}.gguf"
    _write(tiny / "f16.gguf", out, qtype)
    theirs = gguf.GGUFReader(out)
    assert {t.tensor_type.name for t in theirs.tensors} == {qtype, "F32"}
    assert int(theirs.fields["general.file_type"].contents()) == plan.guess_ftype([qtype])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny, gguf_file=out.name, dtype=torch.float32
    )
    loaded = model.state_dict()
    with GGUFFloatReader(out) as reader:
        for t in theirs.tensors:  # gguf-py's floats are qtool's
            ref = np.array(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(-1)
            assert np.array_equal(reader.values(t.name).numpy().reshape(-1), ref), t.name
        pairing = pair_names(reader.header, list(loaded))
        assert (pairing.gguf_unplaced, pairing.hf_unplaced) == ([], [])
        view = HFView(reader, pairing)
        for name in view.names:  # transformers' weights are qtool's, in the HF layout
            assert torch.equal(loaded[name], view.values(name).to(torch.float32)), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny, gguf_file=out.name)
    ids = tokenizer("the cat")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the cat"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert torch.isfinite(logits).all()


def test_the_float_gguf_maps_back_onto_the_hf_checkpoint_exactly(tiny: Path) -> None:
    from safetensors.torch import load_file

    hf = load_file(tiny / "model.safetensors")
    M.write_float_gguf(tiny, tiny / "f32.gguf", "F32")
    with GGUFFloatReader(tiny / "f32.gguf") as reader:
        view, pairing = hf_view(reader, list(hf))
        assert sorted(view.names) == sorted(hf)
        notes = {p.hf: p.note for p in pairing.placed}
        assert notes["model.layers.0.self_attn.k_proj.weight"].startswith("rows un-permuted")
        for name in view.names:
            assert torch.equal(view.values(name), hf[name]), name


def test_llama_cpp_loads_and_generates(tiny: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    out = tiny / "tiny-llama-cpp-Q4_K.gguf"
    _write(tiny / "f16.gguf", out, "Q4_K")
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, verbose=False)
    done = llm("the", max_tokens=4, temperature=0.0)
    assert done["choices"][0]["text"] is not None


def test_tied_embeddings_load_and_map(tmp_path: Path) -> None:
    d = M.make_hf_llama(tmp_path, tied=True)
    M.write_float_gguf(d, d / "f16.gguf", "F16")
    _write(d / "f16.gguf", d / "q8.gguf", "Q8_0")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        d, gguf_file="q8.gguf", dtype=torch.float32
    )
    loaded = model.state_dict()
    assert "lm_head.weight" in loaded
    with GGUFFloatReader(d / "q8.gguf") as reader:
        assert "output.weight" not in reader.names
        view, pairing = hf_view(reader, list(loaded))
        assert {p.hf: p.gguf for p in pairing.placed}["lm_head.weight"] == "token_embd.weight"
        assert (pairing.gguf_unplaced, pairing.hf_unplaced) == ([], [])
        for name in view.names:
            assert torch.equal(loaded[name], view.values(name).to(torch.float32)), name


def test_the_files_qtool_quantize_writes_load_and_run_close_to_the_float_model(
    invoke: Invoke, tiny: Path
) -> None:
    """The command itself (not the library writer): `qtool quantize --format gguf`, one type
    and a budget's per-tensor mix; gguf-py reads each file, transformers loads it with weights
    equal to qtool's dequantization, and its logits stay near the float model's."""
    float_model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        ref = float_model(ids).logits
    runs = {"q8": ["--dtype", "Q8_0"], "mix": ["--target-sqnr", "24"]}
    for name, args in runs.items():
        out = tiny / f"cli-{name}.gguf"
        code, _, err = invoke("quantize", str(tiny / "f16.gguf"), "--format", "gguf",
                              "-o", str(out), *args)  # fmt: skip
        assert code == 0, err
        types = {t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
        assert types - {"F32"}, types
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tiny, gguf_file=out.name, dtype=torch.float32
        )
        loaded = model.state_dict()
        with GGUFFloatReader(out) as reader:
            view, _ = hf_view(reader, list(loaded))
            for hf in view.names:
                assert torch.equal(loaded[hf], view.values(hf).to(torch.float32)), (name, hf)
        with torch.no_grad():
            logits = model(ids).logits
        sqnr = 10 * torch.log10(ref.pow(2).sum() / (logits - ref).pow(2).sum())
        assert sqnr > 15, (name, float(sqnr))
