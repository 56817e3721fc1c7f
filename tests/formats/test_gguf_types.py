"""The ggml type table and GGUF value types against gguf-py's constants."""

from __future__ import annotations

import pytest

from qtool.gguf_types import GGML_TYPES, GGML_TYPES_BY_ID, ValueType, fallback_type, ggml_type

gguf = pytest.importorskip("gguf")


def test_every_gguf_py_type_has_its_id_and_sizes() -> None:
    """gguf-py 0.19.0 on PyPI lacks Q2_0 (newer than it) and says Q8_1 blocks take 40 bytes;
    ggml's block_q8_1 is 2 + 2 + 32 (static_assert in ggml-common.h), and no file stores it."""
    theirs = {t.name: (int(t), *gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType}
    ours = {t.name: (t.id, t.block_size, t.type_size) for t in GGML_TYPES.values()}
    assert ours["Q8_1"] == (9, 32, 36)
    del theirs["Q8_1"], ours["Q8_1"]
    assert {name: ours[name] for name in theirs} == theirs


def test_value_types_are_gguf_py_ones() -> None:
    assert {v.name: int(v) for v in ValueType} == {v.name: int(v) for v in gguf.GGUFValueType}


def test_lookup_by_name_id_or_type() -> None:
    q4k = GGML_TYPES["Q4_K"]
    assert ggml_type("q4_k") is ggml_type(12) is ggml_type(q4k) is GGML_TYPES_BY_ID[12] is q4k
    assert q4k.bits_per_weight == 4.5
    assert q4k.row_bytes(512) == 288
    with pytest.raises(ValueError, match="not a multiple of 256"):
        q4k.row_bytes(100)
    with pytest.raises(KeyError):
        ggml_type(4)  # Q4_2, removed from ggml


@pytest.mark.parametrize(
    ("target", "row", "expected"),
    [
        ("Q4_K", 512, "Q4_K"),
        ("Q4_K", 96, "Q5_0"),
        ("Q5_K", 96, "Q5_1"),
        ("Q6_K", 96, "Q8_0"),
        ("Q2_K", 96, "Q4_0"),
        ("Q6_K", 100, "F16"),
        ("Q8_0", 100, "F16"),
        ("IQ2_XS", 64, "IQ4_NL"),
    ],
)
def test_fallback_types_are_llama_quantize_ones(target: str, row: int, expected: str) -> None:
    assert fallback_type(target, row).name == expected


def test_q8_k_has_no_fallback() -> None:
    with pytest.raises(KeyError, match="no fallback for Q8_K"):
        fallback_type("Q8_K", 32)
