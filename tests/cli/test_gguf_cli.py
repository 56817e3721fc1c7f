"""The GGUF commands end to end through the CLI (issue 23): inspect (types, bits per weight,
totals by type, key metadata), dequantize (every tensor to float under GGUF names), compare
(GGUF vs GGUF; GGUF vs the Hugging Face checkpoint it was converted from, by name, unplaced
tensors listed), quantize --format gguf (bytes as the library writer's, which the consumer tests
prove llama.cpp's readers load; llama-quantize's kept tensors and fallbacks in the table; figures
equal to what the written file reconstructs), recipes and the budget in GGUF types, and
registry.open_matching, what an evaluation reads a GGUF through."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from qtool.formats import registry
from qtool.formats.gguf import hf_state_dict, plan
from qtool.formats.gguf.reader import GGUFFloatReader
from qtool.formats.gguf.writer import write_quantized
from qtool.io.atomic import OutputSet
from qtool.io.gguf_file import GGUFFile
from qtool.spec import gguf_spec
from tests import gguf_models as M
from tests.conftest import Invoke
from tests.gguf_files import odd_gguf

pytest.importorskip("gguf")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama HF directory, its BF16 GGUF (as convert_hf_to_gguf.py writes it) and a
    Q4_K file qtool quantized from it."""
    d = M.make_hf_llama(tmp_path_factory.mktemp("tiny"))
    M.write_float_gguf(d, d / "bf16.gguf", "BF16")
    return d


RECIPE = """ladder = ["Q4_0", "Q4_K", "Q8_0"]

[[rule]]
match = "blk.*.ffn_down.weight"
dtype = "Q6_K"

[[rule]]
match = "token_embd.weight"
keep = "embeddings"
"""


def _json(out: str) -> dict:  # type: ignore[type-arg]
    return json.loads(out)  # type: ignore[no-any-return]


def _quantize(invoke: Invoke, src: Path, out: Path, *args: str) -> dict:  # type: ignore[type-arg]
    code, stdout, err = invoke("quantize", str(src), "--format", "gguf", "-o", str(out), *args,
                               "--json")  # fmt: skip
    assert code == 0, err
    return _json(stdout)


def test_inspect_lists_types_bits_per_weight_totals_and_metadata(
    invoke: Invoke, tiny: Path, tmp_path: Path
) -> None:
    q = tmp_path / "q.gguf"
    _quantize(invoke, tiny / "bf16.gguf", q, "--dtype", "Q4_K")
    code, out, _ = invoke("inspect", str(q), "--json")
    doc = _json(out)
    assert code == 0 and doc["kind"] == "gguf"
    rows = {t["name"]: t for t in doc["tensors"]}
    assert rows["blk.0.attn_q.weight"]["dtype"] == "Q4_K"
    assert rows["blk.0.attn_q.weight"]["bits_per_weight"] == 4.5
    assert rows["blk.0.attn_q.weight"]["shape"] == [256, 256]  # torch order
    assert rows["output_norm.weight"]["dtype"] == "F32"
    by_type = {t["dtype"]: t for t in doc["totals_by_type"]}
    assert by_type["Q4_K"]["tensors"] == 16 and by_type["F32"]["tensors"] == 5
    assert sum(t["bytes"] for t in doc["totals_by_type"]) == doc["totals"]["bytes"]
    meta = doc["metadata"]
    assert meta["architecture"] == "llama" and meta["block_count"] == "2"
    assert meta["file_type"] == "Q4_K - Medium" and meta["vocab_size"] == "263"
    code, text, _ = invoke("inspect", str(q))
    assert code == 0 and "bits/w" in text and "Q4_K: 16 tensors" in text


def test_dequantize_gives_every_tensor_in_float_under_gguf_names(
    invoke: Invoke, tiny: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    q = tmp_path / "q.gguf"
    _quantize(invoke, tiny / "bf16.gguf", q, "--dtype", "Q6_K")
    for to, dtype in ((None, torch.float32), ("bfloat16", torch.bfloat16)):
        out = tmp_path / f"deq-{to}.safetensors"
        args = ["--to", to] if to else []
        code, _, err = invoke("dequantize", str(q), "-o", str(out), *args)
        assert code == 0, err
        restored = load_file(out)
        with GGUFFloatReader(q) as reader:
            assert list(restored) == reader.names or sorted(restored) == sorted(reader.names)
            for name in reader.names:
                want = reader.values(name)
                if reader.quantization(name) is not None or (to and want.is_floating_point()):
                    want = want.to(dtype)  # --to: every float tensor, the norms too
                assert torch.equal(restored[name], want), name
    # a float GGUF converts too (its tensors byte for byte), beside it by default
    shutil.copy(tiny / "bf16.gguf", tmp_path / "bf16.gguf")
    code, _, err = invoke("dequantize", str(tmp_path / "bf16.gguf"))
    assert code == 0, err
    restored = load_file(tmp_path / "bf16.dequantized.safetensors")
    assert restored["blk.0.attn_q.weight"].dtype == torch.bfloat16


def test_compare_gguf_against_gguf_and_against_the_hf_checkpoint(
    invoke: Invoke, tiny: Path, tmp_path: Path
) -> None:
    q = tmp_path / "q.gguf"
    _quantize(invoke, tiny / "bf16.gguf", q, "--dtype", "Q4_K")
    code, out, err = invoke("compare", str(tiny / "bf16.gguf"), str(q), "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in _json(out)["tensors"]}
    assert len(rows) == 21 and rows["blk.0.attn_q.weight"]["sqnr_db"] < 30
    # against the Hugging Face checkpoint: Hugging Face names, q/k un-permuted, gated
    code, out, err = invoke("compare", str(tiny / "model.safetensors"), str(q), "--json",
                            "--min-sqnr", "20")  # fmt: skip
    assert code == 0, err
    doc = _json(out)
    rows = {r["name"]: r for r in doc["tensors"]}
    assert "model.layers.0.self_attn.q_proj.weight" in rows and len(rows) == 21
    assert not any(r["mismatch"] for r in rows.values())
    assert 20 < rows["model.layers.0.self_attn.q_proj.weight"]["sqnr_db"] < 30
    assert invoke("compare", str(tiny / "model.safetensors"), str(q), "--min-sqnr", "30")[0] == 3
    # the float GGUF is the checkpoint exactly (permutation undone), either way round
    M.write_float_gguf(tiny, tmp_path / "f32.gguf", "F32")
    code, out, err = invoke("compare", str(tmp_path / "f32.gguf"), str(tiny), "--json",
                            "--max-mse", "0")  # fmt: skip
    assert code == 0, err
    assert all(r["mse"] == 0 for r in _json(out)["tensors"])


def test_a_tensor_the_mapping_cannot_place_is_a_listed_mismatch(
    invoke: Invoke, tiny: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    hf = load_file(tiny / "model.safetensors")
    hf["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)  # no GGUF name for it
    del hf["model.layers.1.mlp.up_proj.weight"]  # its GGUF tensor has no counterpart now
    save_file(hf, tmp_path / "hf.safetensors")
    code, out, _ = invoke("compare", str(tmp_path / "hf.safetensors"), str(tiny / "bf16.gguf"),
                          "--json")  # fmt: skip
    assert code == 0
    rows = {r["name"]: r for r in _json(out)["tensors"]}
    extra = rows["model.layers.0.mlp.extra_proj.weight"]
    assert extra["mismatch"] and "no GGUF name" in extra["detail"], extra
    orphan = rows["blk.1.ffn_up.weight"]
    assert orphan["mismatch"] and "no tensor of the Hugging Face checkpoint" in orphan["detail"]


def test_quantize_writes_the_library_writers_bytes_with_its_exact_errors(
    invoke: Invoke, tiny: Path, tmp_path: Path
) -> None:
    src = tiny / "bf16.gguf"
    for qtype in ("Q8_0", "Q4_K"):
        out = tmp_path / f"cli-{qtype}.gguf"
        doc = _quantize(invoke, src, out, "--dtype", qtype)
        ref = tmp_path / f"lib-{qtype}.gguf"
        with GGUFFile(src) as f, OutputSet() as outputs:
            asked = {t.name: gguf_spec(qtype) for t in f.header.tensors}
            choices = plan.choose(f.header.tensors, asked, "llama")
            write_quantized(f, choices, ref, outputs)
            outputs.commit()
        assert out.read_bytes() == ref.read_bytes()
        # the table's figures are those of what the written file reconstructs
        code, cmp, _ = invoke("compare", str(src), str(out), "--json")
        measured = {r["name"]: r for r in _json(cmp)["tensors"]}
        for row in doc["tensors"]:
            if row["quantized"]:
                assert row["out_dtype"] == qtype and row["spec"]["gguf_type"] == qtype
                got = measured[row["name"]]
                assert row["mse"] == pytest.approx(got["mse"], rel=1e-9), row["name"]
                assert row["max_abs_error"] == got["max_abs_error"]
        assert sum(r["bytes_out"] for r in doc["tensors"]) < out.stat().st_size


def test_llama_quantizes_choices_are_in_the_table(invoke: Invoke, tmp_path: Path) -> None:
    src = odd_gguf(tmp_path / "odd.gguf")
    doc = _quantize(invoke, src, tmp_path / "q.gguf", "--dtype", "Q4_K")
    rows = {r["name"]: r for r in doc["tensors"]}
    assert rows["token_embd.weight"]["out_dtype"] == "Q4_K"
    fallback = rows["blk.0.attn_q.weight"]
    assert fallback["out_dtype"] == "Q5_0" and "not whole Q4_K blocks" in fallback["detail"]
    assert fallback["decided_by"]["spec"] == "Q5_0"
    none_fits = rows["blk.0.ffn_down.weight"]
    assert not none_fits["quantized"] and "llama-quantize writes F16" in none_fits["detail"]
    assert "expert gate" in rows["blk.0.ffn_gate_inp.weight"]["detail"]
    assert not rows["blk.0.attn_norm.weight"]["quantized"]
    with GGUFFile(tmp_path / "q.gguf") as f:
        types = {t.name: t.type.name for t in f.header.tensors}
        names = [t.name for t in f.header.tensors]
    assert types == {r["name"]: r["out_dtype"] for r in doc["tensors"]}
    assert names == plan.llama_order(names)


def test_a_recipe_and_the_budget_speak_gguf_types(
    invoke: Invoke, tiny: Path, tmp_path: Path
) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE)
    doc = _quantize(invoke, tiny / "bf16.gguf", tmp_path / "mix.gguf", "--recipe", str(recipe),
                    "--target-sqnr", "22")  # fmt: skip
    rows = {r["name"]: r for r in doc["tensors"]}
    assert rows["blk.0.ffn_down.weight"]["out_dtype"] == "Q6_K"
    assert rows["token_embd.weight"]["detail"].startswith("kept: embeddings")
    chosen = {r["out_dtype"] for r in doc["tensors"] if r["decided_by"]["origin"] == "budget"}
    assert chosen and chosen <= {"Q4_0", "Q4_K", "Q8_0"}
    for r in doc["tensors"]:
        if r["decided_by"]["origin"] == "budget":
            assert r["sqnr_db"] >= 22
    # the budget's default ladder for --format gguf is GGUF types; the file is named "mixed"
    shutil.copy(tiny / "bf16.gguf", tmp_path / "bf16.gguf")
    code, _, err = invoke("quantize", str(tmp_path / "bf16.gguf"), "--format", "gguf",
                          "--target-sqnr", "26")  # fmt: skip
    assert code == 0, err
    with GGUFFile(tmp_path / "bf16.mixed.gguf") as f:
        assert {t.type.name for t in f.header.tensors} <= {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "F32"}


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--dtype", "Q4_K"], 2, "Q4_K is a GGUF block type, which --format qtool"),
        (["--format", "gguf"], 2, "--format gguf stores llama.cpp's block types"),
        (["--format", "gguf", "--dtype", "Q4_K", "--group-size", "32"], 2, "drop --group-size"),
        (["--format", "gguf", "--dtype", "IQ2_XXS"], 2, "not a GGUF type qtool quantizes to"),
        (["--format", "gguf", "--dtype", "Q4_K", "--group-fallback", "keep"], 2, "llama-quantize"),
    ],
)
def test_option_combinations_that_cannot_work(
    invoke: Invoke, tiny: Path, args: list[str], code: int, says: str
) -> None:
    got, _, err = invoke("quantize", str(tiny / "bf16.gguf"), *args)
    assert got == code and says in err, err


@pytest.mark.parametrize("dtype", [None, "int8", "uint4"])
def test_a_non_gguf_dtype_is_told_every_type_gguf_takes(
    invoke: Invoke, tiny: Path, dtype: str | None
) -> None:
    """The refusal of an integer --dtype (or none) for --format gguf lists what --dtype takes
    there: the block types and mixes, and the float types a Hugging Face directory converts to
    (they were left out, so a user after llama.cpp's F16 file was never told of them)."""
    args = ["--dtype", dtype] if dtype else []
    code, out, err = invoke("quantize", str(tiny / "bf16.gguf"), "--format", "gguf", *args)
    assert (code, out) == (2, "")
    assert all(t in err for t in ("Q8_0", "Q4_K_M", "F16, BF16 or F32")), err


def test_inputs_the_gguf_format_does_not_take(invoke: Invoke, tiny: Path, tmp_path: Path) -> None:
    code, _, err = invoke("quantize", str(tiny / "model.safetensors"), "--format", "gguf",
                          "--dtype", "Q4_K")  # fmt: skip
    assert code == 2 and "convert_hf_to_gguf.py" in err
    code, _, err = invoke("quantize", str(tiny / "bf16.gguf"))
    assert code == 2 and "is quantized with --format gguf" in err
    q = tmp_path / "q.gguf"
    _quantize(invoke, tiny / "bf16.gguf", q, "--dtype", "Q8_0")
    code, _, err = invoke("quantize", str(q), "--format", "gguf", "--dtype", "Q4_K")
    assert code == 1 and "Q8_0 tensors, not a float checkpoint" in err
    rule = tmp_path / "int.toml"
    rule.write_text('[[rule]]\nmatch = "blk.0.*"\ndtype = "int4"\n')
    code, _, err = invoke("quantize", str(tiny / "bf16.gguf"), "--format", "gguf", "--dtype",
                          "Q4_K", "--recipe", str(rule))  # fmt: skip
    assert code == 2 and "int.toml: line 1: rule 1" in err and "is not a GGUF type" in err
    assert not (tiny / "bf16.Q4_K.gguf").exists()


def test_nan_is_an_error_naming_the_tensor_or_kept(invoke: Invoke, tmp_path: Path) -> None:
    src = odd_gguf(tmp_path / "nan.gguf", nan_in="blk.0.ffn_up.weight")
    out = tmp_path / "q.gguf"
    code, _, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "Q8_0", "-o",
                          str(out))  # fmt: skip
    assert code == 1 and "blk.0.ffn_up.weight" in err and "NaN/Inf" in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["nan.gguf"]
    doc = _quantize(invoke, src, out, "--dtype", "Q8_0", "--keep-nonfinite")
    kept = {r["name"]: r for r in doc["tensors"]}["blk.0.ffn_up.weight"]
    assert not kept["quantized"] and kept["out_dtype"] == "F32"
    with GGUFFloatReader(out) as r:
        assert r.gguf_type("blk.0.ffn_up.weight").name == "F32"
        assert r.gguf_type("token_embd.weight").name == "Q8_0"


def test_open_matching_gives_the_hf_state_dict_an_evaluation_needs(tiny: Path) -> None:
    from safetensors.torch import load_file

    hf = load_file(tiny / "model.safetensors")
    M.write_float_gguf(tiny, tiny / "f32-eval.gguf", "F32")
    state, found = hf_state_dict(tiny / "f32-eval.gguf", list(hf))
    assert found.unplaced == {} and sorted(state) == sorted(hf)
    assert all(torch.equal(state[n], hf[n]) for n in hf)
    matched = registry.open_matching(tiny / "bf16.gguf", list(hf))
    try:
        assert sorted(matched.reader.names) == sorted(hf)
        assert matched.placed["model.embed_tokens.weight"] == "token_embd.weight"
    finally:
        matched.reader.close()
    plain = registry.open_matching(tiny / "model.safetensors", ["anything"])
    try:
        assert plain.unplaced == {} and sorted(plain.reader.names) == sorted(hf)
    finally:
        plain.reader.close()
