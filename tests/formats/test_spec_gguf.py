"""GGUFSpecs, the codec of GGUF block types: labels, JSON and byte counts; existing integer grids
(QSpec) unchanged."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from qtool.gguf_types import GGML_TYPES
from qtool.numerics.budget import DEFAULT_LADDER
from qtool.spec import (
    GGUF_QUANTIZE_TYPES,
    PerGroup,
    QSpec,
    StorageDtype,
    as_grid,
    fit_spec,
    gguf_nbytes,
    gguf_spec,
    gguf_stored_type,
    is_gguf_name,
    parse_spec_label,
    spec_label,
)

# labels and JSON of specs as they were before GGUF types existed (main at a43f2ac)
BEFORE = {
    "int8 channel": {"scheme": "sym", "dtype": "int8", "bits": 8,
                     "granularity": {"kind": "channel", "axis": 0}, "range_method": "minmax",
                     "qmin": -127, "qmax": 127},
    "asym uint4 g128 mse": {"scheme": "asym", "dtype": "uint4", "bits": 4,
                            "granularity": {"kind": "group", "size": 128}, "range_method": "mse",
                            "qmin": 0, "qmax": 15},
    "int4 tensor": {"scheme": "sym", "dtype": "int4", "bits": 4,
                    "granularity": {"kind": "tensor"}, "range_method": "minmax",
                    "qmin": -8, "qmax": 7},
}  # fmt: skip


@pytest.mark.parametrize("label", BEFORE)
def test_existing_specs_keep_their_labels_json_and_equality(label: str) -> None:
    spec = parse_spec_label(label)
    assert spec_label(spec) == label
    assert spec.to_json() == BEFORE[label]
    assert isinstance(spec, QSpec) and spec.kind == "grid"
    assert spec == replace(spec) and hash(spec) == hash(replace(spec))


def test_the_default_ladder_is_unchanged() -> None:
    assert [spec_label(s) for s in DEFAULT_LADDER] == [
        "int4 g128 mse", "int4 g32 mse", "int8 channel", "int8 g128"
    ]  # fmt: skip


@pytest.mark.parametrize("name", [t for t in GGML_TYPES if is_gguf_name(t)])
def test_every_quantized_ggml_type_has_a_label_that_parses_back(name: str) -> None:
    spec = gguf_spec(name)
    assert spec_label(spec) == spec.describe() == name
    assert parse_spec_label(name) == parse_spec_label(f" {name.lower()} ") == spec
    assert spec.to_json() == {
        "gguf_type": name,
        "bits": GGML_TYPES[name].bits_per_weight,
        "block_size": GGML_TYPES[name].block_size,
        "block_bytes": GGML_TYPES[name].type_size,
    }


def test_the_types_qtool_writes_are_gguf_types() -> None:
    assert all(is_gguf_name(t) for t in GGUF_QUANTIZE_TYPES)
    assert [gguf_spec(t).to_json()["bits"] for t in ("Q4_K", "Q6_K", "Q8_0")] == [4.5, 6.5625, 8.5]


def test_what_is_not_a_gguf_block_type_is_refused() -> None:
    for name in ("F16", "BF16", "F32", "I32"):
        assert not is_gguf_name(name)
        with pytest.raises(ValueError, match="not a quantized GGUF type"):
            gguf_spec(name)
    with pytest.raises(ValueError, match="'Q9_K' is not a GGUF type; use one of Q8_0"):
        gguf_spec("Q9_K")
    with pytest.raises(ValueError, match="a GGUF type fixes its block layout; name it alone"):
        parse_spec_label("Q4_K g32")
    with pytest.raises(ValueError, match="unknown word 'F16'"):
        parse_spec_label("F16")


def test_a_gguf_spec_has_no_integer_grid() -> None:
    spec = gguf_spec("Q6_K")
    with pytest.raises(TypeError):
        replace(spec, granularity=PerGroup(32))  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        QSpec(dtype=StorageDtype.INT4, gguf=GGML_TYPES["Q4_K"])  # type: ignore[call-arg]
    for prop in ("qmin", "qmax", "symmetric_zero_point", "axis", "granularity", "dtype"):
        assert not hasattr(spec, prop)
    with pytest.raises(TypeError, match="Q6_K is a GGUF block type, not an integer grid"):
        as_grid(spec)
    assert spec.kind == "gguf" and spec != QSpec()
    assert fit_spec(spec, (64,)) == (spec, "")
    assert fit_spec(spec, ()) == (spec, "")


@pytest.mark.parametrize(
    ("name", "shape", "stored", "nbytes"),
    [
        ("Q4_K", (4096, 4096), "Q4_K", 4096 // 256 * 144 * 4096),
        ("Q4_K", (1536, 576), "Q5_0", 576 // 32 * 22 * 1536),  # SmolLM2's rows of 576
        ("Q6_K", (49152, 576), "Q8_0", 576 // 32 * 34 * 49152),
        ("Q5_K", (8, 576), "Q5_1", 576 // 32 * 24 * 8),
        ("Q4_K", (64, 100), "F16", 100 * 2 * 64),  # the fallback does not fit either
        ("Q8_0", (2, 3, 64), "Q8_0", 2 * 34 * 6),
        ("Q8_0", (64,), "Q8_0", 2 * 34),
        ("Q4_0", (48,), "F16", 96),
    ],
)
def test_bytes_per_shape_follow_llama_quantize_fallbacks(
    name: str, shape: tuple[int, ...], stored: str, nbytes: int
) -> None:
    spec = gguf_spec(name)
    assert gguf_stored_type(spec, shape).name == stored
    assert gguf_nbytes(spec, shape) == nbytes
    bits = GGML_TYPES[stored].bits_per_weight
    assert gguf_nbytes(spec, shape) == math.prod(shape) * bits / 8


def test_each_codec_counts_its_bytes_as_it_lays_them_out() -> None:
    """code_nbytes (what sizes and the budget count) and code_layout (what slabs and the qtool
    writer allocate) agree for every family, packed 4-bit codes and fallback blocks included."""
    specs = [parse_spec_label(s) for s in ("int8", "asym uint4 g32", "int4 tensor")]
    specs += [gguf_spec(t) for t in ("Q8_0", "Q4_K", "Q6_K")]
    for spec in specs:
        for shape in ((64, 256), (3, 256), (2, 4, 512), (5, 96), (5, 7)):
            fitted, _ = spec.fit(shape)
            if fitted.stored_dtype() in ("Q8_0", "Q4_K", "Q6_K") and shape[-1] % 32:
                continue  # no block fits: the GGUF format keeps the tensor as it is
            stored, dtype, _ = fitted.code_layout(shape)
            assert dtype in ("I8", "U8")  # one byte per element of the layout
            assert math.prod(stored) == fitted.code_nbytes(shape), (spec, shape)
