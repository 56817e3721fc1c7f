"""The way back from a quantized GGUF (issue 33, item 8): `dequantize X.gguf -o Y.gguf` writes
a float GGUF that keeps every metadata value (architecture, hyperparameters, tokenizer), every
name, shape and the order, with the quantized tensors as the values ggml dequantizes them to;
gguf-py reads it, and `quantize --format gguf` takes it again and writes a complete GGUF (the
same metadata, new types). quantize's refusal of a quantized GGUF says so."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qtool.formats.gguf import plan
from qtool.formats.gguf.reader import GGUFFloatReader
from qtool.formats.gguf.writer import write_quantized
from qtool.io.atomic import OutputSet
from qtool.io.gguf_file import GGUFFile
from qtool.spec import gguf_spec
from tests import gguf_models as M
from tests.conftest import Invoke

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Q4_K GGUF of the tiny llama, quantized by qtool's library writer from its BF16 GGUF
    (the bytes `quantize --format gguf` writes: test_gguf_cli)."""
    d = M.make_hf_llama(tmp_path_factory.mktemp("tiny"))
    src = M.write_float_gguf(d, d / "bf16.gguf", "BF16")
    with GGUFFile(src) as f, OutputSet() as outputs:
        asked = {t.name: gguf_spec("Q4_K") for t in f.header.tensors}
        write_quantized(f, plan.choose(f.header.tensors, asked, "llama"), d / "q4k.gguf", outputs)
        outputs.commit()
    return d / "q4k.gguf"


def _fields(path: Path) -> dict[str, object]:
    """Every metadata value as gguf-py reads it (general.file_type aside)."""
    r = gguf.GGUFReader(path)
    out: dict[str, object] = {}
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.file_type":
            continue
        out[key] = field.contents()
    return out


def _file_type(path: Path) -> int:
    return int(gguf.GGUFReader(path).fields["general.file_type"].contents())


def test_dequantize_writes_a_float_gguf_with_every_value_and_the_tensors_ggml_reads(
    invoke: Invoke, quantized: Path, tmp_path: Path
) -> None:
    out = tmp_path / "f32.gguf"
    code, stdout, err = invoke("dequantize", str(quantized), "-o", str(out), "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(stdout)["tensors"]}
    assert _fields(out) == _fields(quantized)  # tokenizer, hyperparameters, names: all kept
    assert _file_type(out) == 0  # all F32
    written = gguf.GGUFReader(out)
    with GGUFFloatReader(quantized) as src:
        assert [t.name for t in written.tensors] == src.names
        for t in written.tensors:
            info = src.info(t.name)
            assert tuple(int(d) for d in t.shape) == info.shape
            assert t.tensor_type.name == "F32", t.name
            got = torch.from_numpy(np.array(t.data)).reshape(info.torch_shape)
            assert torch.equal(got, src.values(t.name)), t.name  # bit for bit ggml's values
            assert rows[t.name]["restored"] == (src.quantization(t.name) is not None)


def test_to_converts_the_matrices_and_keeps_1d_tensors_f32(
    invoke: Invoke, quantized: Path, tmp_path: Path
) -> None:
    out = tmp_path / "f16.gguf"
    code, _, err = invoke("dequantize", str(quantized), "-o", str(out), "--to", "float16")
    assert code == 0, err
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == "F16" and types["token_embd.weight"] == "F16"
    assert types["output_norm.weight"] == "F32"  # as convert_hf_to_gguf.py writes norms
    assert _file_type(out) == 1  # mostly F16


def test_quantize_takes_the_float_gguf_back_to_a_complete_gguf(
    invoke: Invoke, quantized: Path, tmp_path: Path
) -> None:
    f32, again = tmp_path / "f32.gguf", tmp_path / "again.Q8_0.gguf"
    assert invoke("dequantize", str(quantized), "-o", str(f32))[0] == 0
    code, _, err = invoke("quantize", str(f32), "--format", "gguf", "--dtype", "Q8_0", "-o",
                          str(again), "--json")  # fmt: skip
    assert code == 0, err
    assert _fields(again) == _fields(quantized)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(again).tensors}
    assert types["blk.1.ffn_down.weight"] == "Q8_0" and types["output_norm.weight"] == "F32"
    assert _file_type(again) == 7  # Q8_0
    # Q4_K again: the values it came from were Q4_K's, so they requantize almost unchanged
    q4k = tmp_path / "again.Q4_K.gguf"
    code, _, err = invoke("quantize", str(f32), "--format", "gguf", "--dtype", "Q4_K", "-o",
                          str(q4k))  # fmt: skip
    assert code == 0, err
    with GGUFFloatReader(quantized) as a, GGUFFloatReader(q4k) as b:
        for name in a.names:
            x, y = a.values(name), b.values(name)
            err2 = float((x - y).pow(2).mean() / x.pow(2).mean())
            assert err2 < 1e-4, name


def test_quantize_refuses_a_quantized_gguf_naming_the_float_gguf_way_back(
    invoke: Invoke, quantized: Path, tmp_path: Path
) -> None:
    code, _, err = invoke("quantize", str(quantized), "--format", "gguf", "--dtype", "Q8_0",
                          "-o", str(tmp_path / "x.gguf"))  # fmt: skip
    assert code == 1 and "qtool dequantize makes a float copy" in err
    assert "in this format when its output ends in .gguf" in err
    assert not (tmp_path / "x.gguf").exists()


def test_only_a_gguf_dequantizes_to_a_gguf(invoke: Invoke, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4, 4)}, tmp_path / "m.safetensors")
    code, stdout, err = invoke("quantize", str(tmp_path / "m.safetensors"), "-o",
                               str(tmp_path / "q.safetensors"))  # fmt: skip
    assert code == 0, err
    code, stdout, err = invoke("dequantize", str(tmp_path / "q.safetensors"), "-o",
                               str(tmp_path / "x.gguf"))  # fmt: skip
    assert code == 2 and "dequantize writes .safetensors" in err and stdout == ""
    assert not (tmp_path / "x.gguf").exists()
