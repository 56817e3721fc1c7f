"""llama.cpp's named mixes (formats/gguf/mixes.py): the type llama-quantize gives each tensor,
on the tiny test llama and on the tensors of real models as llama-quantize typed them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qtool.formats.gguf.mixes import MIXES, ModelFacts, fallback, mix_types, use_more_bits
from qtool.gguf_types import GGML_TYPES, ValueType
from qtool.io.gguf_file import GGUFFile
from qtool.io.gguf_layout import GGUFTensorInfo, GGUFValue
from tests import gguf_models as M
from tests.conftest import Invoke

RECORDED = Path(__file__).parents[1] / "data" / "gguf_mixes_llama_quantize.json"


def _info(name: str, *shape: int) -> GGUFTensorInfo:
    return GGUFTensorInfo(name, GGML_TYPES["F32"], shape, 0, 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[GGUFTensorInfo], ModelFacts]:
    d = tmp_path_factory.mktemp("tiny")
    M.make_hf_llama(d)
    with GGUFFile(M.write_float_gguf(d, d / "f32.gguf")) as f:
        return list(f.header.tensors), ModelFacts.of(f.header.metadata)


# the tiny llama: 2 layers, 4 heads / 2 KV heads (n_gqa 2), rows of 256 and 512, untied output.
# Layer 1 is "more bits" (use_more_bits(1, 2): 1 >= 7 * 2 // 8), layer 0 is not.
TINY = {
    "Q4_K_M": {"attn_v": ("Q4_K", "Q6_K"), "ffn_down": ("Q4_K", "Q6_K"), "attn_output": "Q4_K"},
    "Q5_K_M": {"attn_v": ("Q5_K", "Q6_K"), "ffn_down": ("Q5_K", "Q6_K"), "attn_output": "Q5_K"},
    "Q4_K_S": {"attn_v": ("Q5_K", "Q5_K"), "ffn_down": ("Q4_K", "Q4_K"), "attn_output": "Q4_K"},
    "Q3_K_M": {"attn_v": ("Q5_K", "Q5_K"), "ffn_down": ("Q4_K", "Q4_K"), "attn_output": "Q4_K"},
    "Q3_K_L": {"attn_v": ("Q5_K", "Q5_K"), "ffn_down": ("Q5_K", "Q5_K"), "attn_output": "Q5_K"},
    "Q3_K_S": {"attn_v": ("Q3_K", "Q3_K"), "ffn_down": ("Q3_K", "Q3_K"), "attn_output": "Q3_K"},
    "Q2_K": {"attn_v": ("Q3_K", "Q3_K"), "ffn_down": ("Q3_K", "Q3_K"), "attn_output": "Q3_K"},
    "Q6_K": {"attn_v": ("Q6_K", "Q6_K"), "ffn_down": ("Q6_K", "Q6_K"), "attn_output": "Q6_K"},
    "Q8_0": {"attn_v": ("Q8_0", "Q8_0"), "ffn_down": ("Q8_0", "Q8_0"), "attn_output": "Q8_0"},
}


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_llama_gets_llama_quantizes_types(
    name: str, tiny: tuple[list[GGUFTensorInfo], ModelFacts]
) -> None:
    tensors, facts = tiny
    mix = MIXES[name]
    types = mix_types(mix, tensors, facts)
    want = TINY[name]
    output = "Q8_0" if mix.default == "Q8_0" else "Q6_K"
    assert types.pop("output.weight") == output
    assert types.pop("token_embd.weight") == mix.default  # untied: the default type
    for layer in (0, 1):
        for cat in ("attn_v", "ffn_down"):
            assert types.pop(f"blk.{layer}.{cat}.weight") == want[cat][layer], (cat, layer)
        assert types.pop(f"blk.{layer}.attn_output.weight") == want["attn_output"]
    rest = {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_gate.weight",
            "blk.0.ffn_up.weight", "blk.1.attn_q.weight", "blk.1.attn_k.weight",
            "blk.1.ffn_gate.weight", "blk.1.ffn_up.weight"}  # fmt: skip
    assert types == dict.fromkeys(rest, mix.default)  # norms are kept: absent


def test_tied_embeddings_get_the_output_rule() -> None:
    """Without output.weight, token_embd is the output: Q6_K, or Q8_0 when its rows of 576
    are not whole K blocks (SmolLM2)."""
    facts = ModelFacts("llama", 2, 9, 3)
    tensors = [_info("token_embd.weight", 576, 100), _info("blk.0.attn_q.weight", 576, 576)]
    types = mix_types(MIXES["Q4_K_M"], tensors, facts)
    assert types == {"token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "Q5_0"}
    tensors[0] = _info("token_embd.weight", 512, 100)
    assert mix_types(MIXES["Q4_K_M"], tensors, facts)["token_embd.weight"] == "Q6_K"


def test_fallbacks_for_rows_that_are_not_whole_blocks() -> None:
    assert [fallback(t, 576) for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0")] == [
        "Q4_0", "Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q8_0"]  # fmt: skip
    assert fallback("Q4_K", 100) == "F16" and fallback("Q4_0", 48) == "F16"
    assert fallback("Q4_K", 512) == "Q4_K"


def test_more_bits_layers_of_a_32_layer_model() -> None:
    """use_more_bits: the first and last eighth, and every third layer between."""
    more = [i for i in range(32) if use_more_bits(i, 32)]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_experts_gqa_70b_and_imatrix_rules() -> None:
    layers = 80
    tensors = [_info(f"blk.{i}.{n}.weight", 8192, 1024) for i in range(layers)
               for n in ("attn_v", "attn_k", "ffn_down")]  # fmt: skip
    big = ModelFacts("llama", layers, 64, 8)  # n_gqa 8: a 70B
    types = mix_types(MIXES["Q3_K_M"], tensors, big)
    assert types["blk.0.attn_v.weight"] == "Q5_K"  # i < 2
    assert types["blk.2.attn_v.weight"] == "Q5_K"  # Q4_K raised for a 70B
    types = mix_types(MIXES["Q2_K"], tensors, big)
    assert types["blk.5.attn_v.weight"] == "Q5_K"  # n_gqa >= 4: Q4_K, then the 70B rule
    moe = ModelFacts("llama", layers, 32, 8, n_expert=8)
    types = mix_types(MIXES["Q4_K_M"], tensors, moe)
    assert types["blk.7.attn_v.weight"] == types["blk.7.attn_k.weight"] == "Q8_0"
    plain = ModelFacts("llama", layers, 32, 32)
    q4_0 = mix_types(MIXES["Q4_0"], tensors, plain, imatrix=True)
    assert [q4_0[f"blk.{i}.ffn_down.weight"] for i in (0, 9, 10)] == ["Q4_1", "Q4_1", "Q4_0"]
    assert mix_types(MIXES["Q4_0"], tensors, plain)["blk.0.ffn_down.weight"] == "Q4_0"


def test_file_types_are_llama_ftype_values() -> None:
    assert {n: m.ftype for n, m in MIXES.items()} == {
        "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11,
        "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17,
        "Q6_K": 18}  # fmt: skip


@pytest.mark.parametrize("name", ["Q4_K_M", "Q3_K_S", "Q5_K_M"])
def test_dtype_names_a_mix_on_the_command_line(
    name: str, tiny: tuple[list[GGUFTensorInfo], ModelFacts], tmp_path: Path, invoke: Invoke
) -> None:
    """`quantize --format gguf --dtype Q4_K_M` writes each tensor in the mix's type and
    general.file_type as llama-quantize does (15 for Q4_K_M)."""
    tensors, facts = tiny
    d = tmp_path / "hf"
    M.make_hf_llama(d)
    src = M.write_float_gguf(d, d / "f32.gguf")
    out = tmp_path / f"out.{name}.gguf"
    code, _, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", name.lower(),
                          "-o", str(out))  # fmt: skip
    assert code == 0, err
    with GGUFFile(out) as f:
        written = {t.name: t.type.name for t in f.header.tensors if t.type.name != "F32"}
        assert f.header.metadata["general.file_type"].value == MIXES[name].ftype
    assert written == mix_types(MIXES[name], tensors, facts)


def _llama_quantize() -> str | None:
    return os.environ.get("QTOOL_LLAMA_QUANTIZE") or shutil.which("llama-quantize")


@pytest.mark.skipif(_llama_quantize() is None, reason="llama-quantize not found (optional)")
def test_llama_quantize_itself_gives_the_same_types(tmp_path: Path) -> None:
    """llama-quantize --dry-run (QTOOL_LLAMA_QUANTIZE or on PATH) on the tiny llama, every
    mix: scripts/gguf_mixes_check.py exits 1 when one tensor's type differs."""
    d = tmp_path / "hf"
    M.make_hf_llama(d)
    src = M.write_float_gguf(d, d / "f32.gguf")
    script = Path(__file__).parents[2] / "scripts" / "gguf_mixes_check.py"
    run = subprocess.run([sys.executable, str(script), str(_llama_quantize()), str(src)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def _recorded() -> list[dict[str, object]]:
    return json.loads(RECORDED.read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("model", [m["model"] for m in _recorded()])
def test_every_mix_as_llama_quantize_typed_real_tensor_lists(model: str) -> None:
    """llama-quantize --dry-run's types (scripts/gguf_mixes_check.py --record, llama.cpp
    0.3.36's tree): the tiny llama untied and tied, the 64-wide sample (every K-type falls
    back) and SmolLM2-135M (30 layers, 9/3 heads, tied, rows of 576), all 14 mixes."""
    entry = next(m for m in _recorded() if m["model"] == model)
    meta = entry["metadata"]
    assert isinstance(meta, dict)
    values = {
        k: GGUFValue(ValueType.STRING if isinstance(v, str) else ValueType.UINT32, v)
        for k, v in meta.items()
    }
    facts = ModelFacts.of(values)
    tensors = [_info(n, *shape) for n, shape in entry["tensors"]]  # type: ignore[attr-defined]
    types = entry["types"]
    assert isinstance(types, dict) and set(types) == set(MIXES)
    for name, theirs in types.items():
        assert mix_types(MIXES[name], tensors, facts) == theirs, name


@pytest.mark.skipif(_llama_quantize() is None, reason="llama-quantize not found (optional)")
@pytest.mark.parametrize("name", ["Q4_K_M", "Q3_K_M", "Q2_K"])
def test_the_written_tensors_are_llama_quantizes_bytes(
    name: str, tmp_path: Path, invoke: Invoke
) -> None:
    """llama-quantize's file and qtool's of the same mix hold the same bytes in every tensor
    (ggml-quants.c is in ggml-base, built without -march, as the goldens'). Q2_K: qtool's
    --dtype Q2_K is the pure type, llama-quantize's --pure."""
    d = tmp_path / "hf"
    M.make_hf_llama(d)
    src = M.write_float_gguf(d, d / "f32.gguf")
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    pure = ["--pure"] if name == "Q2_K" else []
    subprocess.run([str(_llama_quantize()), *pure, str(src), str(theirs), name],
                   capture_output=True, check=True, timeout=600)  # fmt: skip
    code, _, err = invoke(
        "quantize", str(src), "--format", "gguf", "--dtype", name, "-o", str(ours)
    )
    assert code == 0, err
    with GGUFFile(theirs) as a, GGUFFile(ours) as b:
        ta, tb = a.header.by_name(), b.header.by_name()
        assert set(ta) == set(tb)
        for n, info in ta.items():
            assert info.type == tb[n].type, n
            x, y = np.empty(info.nbytes, np.uint8), np.empty(tb[n].nbytes, np.uint8)
            a.read_into(info, x)
            b.read_into(tb[n], y)
            assert np.array_equal(x, y), n


@pytest.mark.skipif(_llama_quantize() is None, reason="llama-quantize not found (optional)")
@pytest.mark.parametrize("name", ["Q4_K_M", "Q3_K_S", "Q2_K", "Q4_1", "Q5_0"])
def test_with_an_importance_matrix_the_tensors_are_llama_quantizes_bytes(
    name: str, tmp_path: Path
) -> None:
    """llama-quantize --imatrix on the tiny llama with a random importance matrix, against
    numerics.gguf.quantize(..., quant_weights=imatrix.quant_weights(...)) tensor by tensor:
    the ggml *_impl paths and what llama-quantize derives from the file."""
    from qtool.formats.gguf.reader import PLAIN
    from qtool.formats.imatrix.ggufimatrix import write_gguf_imatrix
    from qtool.numerics import gguf as G
    from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats, quant_weights

    d = tmp_path / "hf"
    M.make_hf_llama(d)
    src = M.write_float_gguf(d, d / "f32.gguf")
    rng = np.random.default_rng(5)
    with GGUFFile(src) as f:
        weights = [t for t in f.header.tensors if len(t.shape) == 2]
    entries = {
        t.name: MatrixStats((rng.random((1, t.shape[0])) ** 3 * 50).astype(np.float32),
                            np.array([int(rng.integers(1, 900))], dtype=np.int64))
        for t in weights if t.name != "token_embd.weight"
    }  # fmt: skip
    imatrix = tmp_path / "imatrix.gguf"
    write_gguf_imatrix(imatrix, ImportanceMatrix(entries, 512, 1, ("random",)))
    out = tmp_path / "theirs.gguf"
    pure = ["--pure"] if name == "Q2_K" else []
    subprocess.run([str(_llama_quantize()), *pure, "--imatrix", str(imatrix), str(src), str(out),
                    name], capture_output=True, check=True, timeout=600)  # fmt: skip
    import torch

    checked = 0
    with GGUFFile(src) as a, GGUFFile(out) as b:
        for info in b.header.tensors:
            own = a.header.by_name()[info.name]
            if info.type == own.type:
                continue
            raw = np.empty(own.nbytes, np.uint8)
            a.read_into(own, raw)
            x = torch.from_numpy(raw).view(PLAIN[own.type.name]).reshape(own.torch_shape)
            stats = entries.get(info.name)
            qw = None if stats is None else torch.from_numpy(quant_weights(stats, own.shape[0])[0])
            ours = G.quantize(x.float(), info.type.name, quant_weights=qw).numpy().reshape(-1)
            theirs = np.empty(info.nbytes, np.uint8)
            b.read_into(info, theirs)
            assert np.array_equal(ours, theirs), (info.name, info.type.name)
            checked += 1
    assert checked == 16
