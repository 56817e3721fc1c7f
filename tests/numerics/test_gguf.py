"""GGUF block kernels: bytes of ggml's C reference (goldens), of gguf.quants, and of a scalar
transcription of the C (tests/reference_gguf.py) where hypothesis explores beyond the goldens."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qtool.gguf_types import GGML_TYPES
from qtool.numerics import gguf as G
from tests.reference_gguf import REFERENCE

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

GOLDEN = np.load(Path(__file__).parents[1] / "data" / "gguf_golden.npz")
X = GOLDEN["x"]  # (207, 256) float32, hostile rows first
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
TRANSCRIBED = [t for t in K_TYPES if t in REFERENCE]  # tests/reference_gguf.py
LEGACY = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16", "F32"]


def _gguf_quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """gguf.quants' bytes, quiet about the overflows that hostile rows cause in numpy."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = quants.quantize(x, GGMLQuantizationType[qtype])
    return out.view(np.uint8).reshape(x.shape[0], -1)


def _gguf_dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return quants.dequantize(raw, GGMLQuantizationType[qtype])


def _bad_rows(ours: torch.Tensor, ref: np.ndarray) -> list[int]:
    return np.nonzero((ours.cpu().numpy() != ref).any(axis=1))[0].tolist()


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_types_are_byte_identical_to_the_c_reference(qtype: str, device: str) -> None:
    ours = G.quantize(torch.from_numpy(X).to(device), qtype)
    assert _bad_rows(ours, GOLDEN[qtype.lower()]) == []


@pytest.mark.parametrize("qtype", K_TYPES)
def test_rows_of_several_blocks_and_chunks_give_the_same_bytes(
    qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(G.CODECS, qtype, dataclasses.replace(G.CODECS[qtype], chunk=7))
    x = torch.from_numpy(X[:206]).reshape(103, 512)  # 2 super-blocks a row, in 30 chunks
    ours = G.quantize(x, qtype)
    assert ours.shape == (103, 2 * GGML_TYPES[qtype].type_size)
    assert _bad_rows(ours.reshape(206, -1), GOLDEN[qtype.lower()][:206]) == []


@pytest.mark.parametrize("qtype", [*K_TYPES, "Q8_0", "Q4_1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_any_float_dtype_is_quantized_as_its_float32_value(qtype: str, dtype: torch.dtype) -> None:
    x = torch.from_numpy(X[37:77]).to(dtype)
    assert torch.equal(G.quantize(x, qtype), G.quantize(x.to(torch.float32), qtype))


@pytest.mark.parametrize("qtype", TRANSCRIBED)
def test_the_scalar_transcription_matches_the_goldens(qtype: str) -> None:
    rows = [0, 5, 7, 12, 14, 15, 19, 23, 28, 29, 31, 37, 80, 140, 170, 200]  # hostile + random
    for r in rows:
        assert REFERENCE[qtype](X[r]) == GOLDEN[qtype.lower()][r].tobytes(), f"row {r}"


def _blocks() -> st.SearchStrategy[np.ndarray]:
    """One super-block: values of mixed magnitudes, zeros and repeats (ties)."""
    elements = st.one_of(
        st.floats(-2.0, 2.0, width=32),
        st.sampled_from([0.0, -0.0, 0.5, -0.5, 1.0, 1e-38, -3e-39, 7.0]),
        st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=True),
    )
    return hnp.arrays(np.float32, 256, elements=elements)


@settings(max_examples=20, deadline=None)
@given(block=_blocks(), exp=st.integers(-20, 20), qtype=st.sampled_from(TRANSCRIBED))
def test_k_types_match_the_transcription_beyond_the_goldens(
    block: np.ndarray, exp: int, qtype: str
) -> None:
    block = (block * np.float32(2.0**exp)).astype(np.float32)
    if not np.isfinite(block).all():
        return
    ours = G.quantize(torch.from_numpy(block), qtype).numpy().tobytes()
    assert ours == REFERENCE[qtype](block)


@pytest.mark.parametrize("qtype", LEGACY[:5])
def test_legacy_types_are_byte_identical_to_the_c_reference(qtype: str, device: str) -> None:
    x = GOLDEN["legacy_x"]  # the hostile rows, then blocks where a zero's sign matters
    ours = G.quantize(torch.from_numpy(x).to(device), qtype)
    assert _bad_rows(ours, GOLDEN[f"legacy_{qtype.lower()}"]) == []
    if qtype != "Q8_0":  # gguf.quants gets these signs wrong
        assert _bad_rows(ours, _gguf_quantize(x, qtype)) != []


def _with_c_zero_signs(x: np.ndarray, qtype: str, ref: np.ndarray) -> np.ndarray:
    """gguf.quants' bytes with the block header as C computes it where a zero's sign differs:
    C's min/max are the first of equal values met (+0.0 or -0.0), its Q4_0/Q5_0 maximum
    starts at +0.0."""
    blocks = x.reshape(-1, 32)
    out = ref.reshape(len(blocks), -1).copy()
    if qtype in ("Q4_0", "Q5_0"):
        zero = np.abs(blocks).max(-1) == 0
        out[zero, :2] = np.array([-0.0], np.float16).view(np.uint8)  # +0.0 / -8 or -16
    if qtype in ("Q4_1", "Q5_1"):
        rows = np.arange(len(blocks))
        lo = blocks[rows, (blocks == blocks.min(-1, keepdims=True)).argmax(-1)]
        hi = blocks[rows, (blocks == blocks.max(-1, keepdims=True)).argmax(-1)]
        with np.errstate(all="ignore"):
            d = (hi - lo) / np.float32(15 if qtype == "Q4_1" else 31)
            out[:, :2] = d.astype(np.float16)[:, None].view(np.uint8)
            out[:, 2:4] = lo.astype(np.float16)[:, None].view(np.uint8)
    return out.reshape(ref.shape)


@pytest.mark.parametrize("qtype", LEGACY)
def test_legacy_types_match_gguf_quants_on_the_hostile_rows(qtype: str, device: str) -> None:
    ours = G.quantize(torch.from_numpy(X).to(device), qtype)
    assert _bad_rows(ours, _gguf_quantize(X, qtype)) == []


@given(
    x=hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 4), st.integers(1, 3).map(lambda b: 32 * b)),
        elements=st.floats(width=32, allow_nan=False, allow_infinity=False),
    ),
    qtype=st.sampled_from(LEGACY),
)
def test_legacy_types_match_gguf_quants(x: np.ndarray, qtype: str) -> None:
    ours = G.quantize(torch.from_numpy(x), qtype)
    assert _bad_rows(ours, _with_c_zero_signs(x, qtype, _gguf_quantize(x, qtype))) == []


def _same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical except NaN payloads (a NaN fp16 scale is a damaged file either way)."""
    nan = np.isnan(a)
    return bool((nan == np.isnan(b)).all() and (a.view(np.uint32) == b.view(np.uint32))[~nan].all())


@pytest.mark.parametrize("qtype", G.DEQUANTIZE_TYPES)
def test_dequantize_matches_gguf_quants_on_any_bytes(qtype: str, device: str) -> None:
    size = GGML_TYPES[qtype].type_size
    raw = np.random.default_rng(23).integers(0, 256, (16, 8 * size), dtype=np.uint8)
    ours = G.dequantize(torch.from_numpy(raw).to(device), qtype).cpu().numpy()
    assert _same_floats(ours, _gguf_dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", G.QUANTIZE_TYPES)
def test_dequantize_of_quantized_rows_matches_gguf_quants(qtype: str) -> None:
    raw = G.quantize(torch.from_numpy(X), qtype).numpy()
    ours = G.dequantize(torch.from_numpy(raw), qtype).numpy()
    assert ours.shape == X.shape
    assert _same_floats(ours, _gguf_dequantize(raw, qtype))


def test_misuse_is_a_value_error() -> None:
    x = torch.zeros(2, 256)
    with pytest.raises(ValueError, match="cannot quantize to IQ2_XXS"):
        G.quantize(x, "IQ2_XXS")
    with pytest.raises(ValueError, match="not multiples of 32"):
        G.quantize(torch.zeros(2, 48), "Q8_0")
    with pytest.raises(ValueError, match="float tensor"):
        G.quantize(torch.zeros(2, 32, dtype=torch.int32), "Q8_0")
    with pytest.raises(KeyError, match="unknown ggml type"):
        G.quantize(x, "Q9_9")
    with pytest.raises(ValueError, match="uint8 rows of 144-byte blocks"):
        G.dequantize(torch.zeros(2, 100, dtype=torch.uint8), "Q4_K")
    with pytest.raises(ValueError, match="cannot dequantize IQ2_XXS"):
        G.dequantize(torch.zeros(2, 66, dtype=torch.uint8), "IQ2_XXS")


@pytest.mark.parametrize("qtype", G.QUANTIZE_TYPES)
def test_empty_input_and_the_input_left_untouched(qtype: str) -> None:
    assert G.quantize(torch.zeros(0, 256), qtype).shape == (0, GGML_TYPES[qtype].row_bytes(256))
    x = torch.from_numpy(X[:8].copy())
    before = x.clone()
    G.quantize(x, qtype)
    assert torch.equal(x, before)
