"""numerics/fused.py against the torch kernels (the reference) and the independent numpy
reference: codes, scales, zero points and mse choices bit for bit, error sums to 1e-6 relative,
dequantize bit for bit. Skipped cleanly without numba (pip install 'qtool[fast]')."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from qtool.numerics import fused, kernels  # noqa: E402
from qtool.numerics.range_methods import search_candidates  # noqa: E402
from qtool.numerics.ranges import NonFiniteInput  # noqa: E402
from qtool.spec import (  # noqa: E402
    Granularity,
    PerChannel,
    PerGroup,
    PerTensor,
    QSpec,
    RangeMethod,
    Scheme,
    StorageDtype,
)
from tests import reference  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}
GRANULARITIES = {
    "tensor": PerTensor(),
    "axis0": PerChannel(0),
    "axis1": PerChannel(1),
    "last-axis": PerChannel(-1),
    "group16": PerGroup(16),
    "group5-short-tail": PerGroup(5),
}
SCALE_DTYPES = {
    "scale-f32": torch.float32,
    "scale-bf16": torch.bfloat16,
    "scale-f16": torch.float16,
}
PAIRS = [(s, d) for s in Scheme for d in StorageDtype]
PAIR_IDS = [f"{s.value}-{d.value}" for s, d in PAIRS]
# mse per tensor or on a late axis runs the torch kernels (fused.supports)
COVERED = [
    (g, m)
    for g in (PerChannel(0), PerGroup(4), PerTensor(), PerChannel(1))
    for m in RangeMethod
    if m is RangeMethod.MINMAX or not isinstance(g, PerTensor) and g != PerChannel(1)
]


def special(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random values plus rows that are zero, constant, denormal, -0.0, all negative, and one
    outlier: the cases where qparams take their special branches."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 0.05
    for i, v in enumerate([0.0, 0.25, 3e-41, -0.0, -1.5][: max(0, shape[0] - 2)]):
        x[i + 1] = v
    if shape[0] > 1:
        x[-1] = -x[-1].abs()
    x.view(-1)[0] = 9.0
    return x


def assert_same(
    x: torch.Tensor,
    spec: QSpec,
    scale_dtype: torch.dtype = torch.float32,
    with_errors: bool = True,
) -> None:
    """The fused result equals the torch kernels' (errors: see assert_errors); an input the
    torch kernels refuse is refused with the same exception and message."""
    try:
        ref = kernels.quantize_tensor(x, spec, scale_dtype=scale_dtype, with_errors=with_errors)
    except ValueError as want:
        with pytest.raises(ValueError) as err:
            fused.quantize_tensor(x, spec, scale_dtype=scale_dtype, with_errors=with_errors)
        assert type(err.value) is type(want) and str(err.value) == str(want)
        return
    got = fused.quantize_tensor(x, spec, scale_dtype=scale_dtype, with_errors=with_errors)
    assert got.q.dtype == ref.q.dtype and torch.equal(got.q, ref.q)
    assert got.scale.dtype == torch.float32 and torch.equal(got.scale, ref.scale)
    assert got.zero_point.dtype == ref.zero_point.dtype
    assert torch.equal(got.zero_point, ref.zero_point)
    assert (got.choice is None) == (ref.choice is None)
    if ref.choice is not None and got.choice is not None:
        assert torch.equal(got.choice, ref.choice)
    if with_errors:
        assert_errors(x, got.errors, ref.errors)
    else:
        assert got.errors is None


def assert_errors(x: torch.Tensor, got: object, ref: object) -> None:
    """The figures are equal to the last bit (numerics/metrics.py: one definition, x_hat as
    restored, the canonical chunk sums), min-max's squared error of an mse search included."""
    assert got is not None and ref is not None
    assert got == ref
    assert got.numel == x.numel()  # type: ignore[attr-defined]


# ---------------------------------------------------------------- against the torch kernels


@pytest.mark.parametrize("gran", list(GRANULARITIES.values()), ids=list(GRANULARITIES))
@pytest.mark.parametrize(("scheme", "storage"), PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_minmax_matches_torch_kernels(
    dtype: torch.dtype, scheme: Scheme, storage: StorageDtype, gran: Granularity
) -> None:
    x = special((9, 5, 7), seed=1).to(dtype)
    assert_same(x, QSpec(scheme, storage, gran))


@pytest.mark.parametrize("gran", [PerChannel(0), PerGroup(16), PerGroup(5)], ids=str)
@pytest.mark.parametrize(("scheme", "storage"), PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_mse_search_matches_torch_kernels(
    dtype: str, scheme: Scheme, storage: StorageDtype, gran: Granularity
) -> None:
    x = special((9, 35), seed=2).to(DTYPES[dtype])
    assert_same(x, QSpec(scheme, storage, gran, RangeMethod.MSE))


@pytest.mark.parametrize("scale_dtype", list(SCALE_DTYPES.values()), ids=list(SCALE_DTYPES))
@pytest.mark.parametrize(("gran", "method"), COVERED, ids=[f"{g}-{m.value}" for g, m in COVERED])
def test_scales_rounded_to_the_weight_dtype_match(
    scale_dtype: torch.dtype, gran: Granularity, method: RangeMethod
) -> None:
    """Scales stored as bf16/fp16 (compressed-tensors): rounded in the kernel, codes against
    the rounded value; tiny groups reach fp16's subnormal scales."""
    x = special((6, 24), seed=3) * torch.logspace(-9, 3, 24)
    for scheme, storage in PAIRS:
        assert_same(x.to(scale_dtype), QSpec(scheme, storage, gran, method), scale_dtype)


def test_without_error_figures() -> None:
    for gran in GRANULARITIES.values():
        assert_same(special((4, 6, 3), seed=4), QSpec(granularity=gran), with_errors=False)


def test_long_rows_and_segments_match() -> None:
    """Past the torch path's slab (2^21 elements) and the fused per-tensor block (2^12)."""
    x = torch.randn(3, 700_001, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for spec in (
        QSpec(Scheme.ASYM, StorageDtype.UINT8, PerTensor()),
        QSpec(granularity=PerChannel(1)),
        QSpec(),
        QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(128)),
    ):
        assert_same(x, spec)


@pytest.mark.parametrize("axis", [1, 2], ids=["axis1-runs-of-300", "last-axis-columns"])
def test_late_axis_layouts_match(axis: int) -> None:
    """Per channel after axis 0: long runs (segment kernels) and short ones (column kernels)."""
    x = torch.randn(3, 5, 300, generator=torch.Generator().manual_seed(6))
    x[:, 2] = 0.0
    for scheme, storage in PAIRS:
        assert_same(x.to(torch.bfloat16), QSpec(scheme, storage, PerChannel(axis)))


SPECS = st.builds(
    QSpec,
    st.sampled_from(list(Scheme)),
    st.sampled_from(list(StorageDtype)),
    st.one_of(
        st.just(PerTensor()),
        st.builds(PerChannel, st.integers(-2, 2)),
        st.builds(PerGroup, st.integers(2, 40)),
    ),
    st.sampled_from(list(RangeMethod)),
)
ROWS = st.sampled_from(["random", "zero", "constant", "denormal", "ties", "negative", "huge"])


def _fill(x: torch.Tensor, kinds: list[str], seed: int) -> torch.Tensor:
    """Row i of the [C, K] view made of kind i: the special cases hypothesis mixes."""
    rows = x.reshape(x.shape[0], -1) if x.ndim else x.reshape(1, 1)
    g = torch.Generator().manual_seed(seed)
    for i, kind in enumerate(kinds[: rows.shape[0]]):
        n = rows.shape[1]
        values = {
            "random": torch.randn(n, generator=g),
            "zero": torch.zeros(n),
            "constant": torch.full((n,), -0.3),
            "denormal": torch.randn(n, generator=g) * 1e-40,
            "ties": torch.arange(n, dtype=torch.float32) - n / 2 + 0.5,
            "negative": -torch.rand(n, generator=g),
            "huge": torch.randn(n, generator=g) * 1e30,
        }[kind]
        rows[i] = values
    return x


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    dtype=st.sampled_from(list(DTYPES)),
    spec=SPECS,
    scale_dtype=st.sampled_from(list(SCALE_DTYPES.values())),
    kinds=st.lists(ROWS, min_size=1, max_size=9),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_and_rows_match_torch_kernels(
    shape: list[int],
    dtype: str,
    spec: QSpec,
    scale_dtype: torch.dtype,
    kinds: list[str],
    seed: int,
) -> None:
    g = spec.granularity
    if isinstance(g, PerChannel) and not -len(shape) <= g.axis < len(shape):
        spec = QSpec(spec.scheme, spec.dtype, PerChannel(0), spec.range_method)
    if not fused.supports(spec, len(shape)):
        spec = QSpec(spec.scheme, spec.dtype, PerGroup(3), spec.range_method)
    x = _fill(torch.zeros(shape), kinds, seed).to(DTYPES[dtype])
    assert_same(x, spec, scale_dtype)


# ---------------------------------------------------------------- against the numpy reference


def _ref_granularity(g: Granularity, ndim: int) -> tuple[str, int]:
    if isinstance(g, PerTensor):
        return ("tensor", 0)
    if isinstance(g, PerChannel):
        return ("channel", g.axis % ndim)
    return ("group", g.size)


def _unpacked(q: torch.Tensor, spec: QSpec, shape: tuple[int, ...]) -> np.ndarray:
    from qtool.numerics.packing import unpack_nibbles

    if spec.dtype.packed:
        q = unpack_nibbles(q, shape[-1], spec.dtype.signed).reshape(shape)
    return q.numpy().astype(np.int64)


@pytest.mark.parametrize(("gran", "method"), COVERED, ids=[f"{g}-{m.value}" for g, m in COVERED])
@pytest.mark.parametrize(("scheme", "storage"), PAIRS, ids=PAIR_IDS)
def test_matches_numpy_reference(
    scheme: Scheme, storage: StorageDtype, gran: Granularity, method: RangeMethod
) -> None:
    spec = QSpec(scheme, storage, gran, method)
    x = special((7, 22), seed=7).to(torch.bfloat16)
    got = fused.quantize_tensor(x, spec)
    candidates = list(search_candidates(spec, tuple(x.shape)))
    codes, scales, zps, choices = reference.quantize_v2(
        x.float().numpy(),
        scheme.value,
        storage.value,
        _ref_granularity(gran, x.ndim),
        method.value,
        candidates,
    )
    np.testing.assert_array_equal(_unpacked(got.q, spec, tuple(x.shape)), codes)
    np.testing.assert_array_equal(got.scale.numpy(), scales)
    np.testing.assert_array_equal(got.zero_point.numpy().astype(np.int64), zps)
    if got.choice is not None:
        np.testing.assert_array_equal(got.choice.numpy().astype(np.int64), choices)


@pytest.mark.parametrize(("scheme", "storage"), PAIRS, ids=PAIR_IDS)
def test_ties_round_half_to_even(scheme: Scheme, storage: StorageDtype) -> None:
    """x / scale = k + 0.5 exactly (scale 1.0): codes follow round-half-to-even."""
    spec = QSpec(scheme, storage, PerTensor())
    steps = spec.qmax - spec.qmin
    divisor = steps / 2 if scheme is Scheme.SYM else steps
    lo = 0.0 if scheme is Scheme.SYM else -math.floor(divisor / 2)
    hi = divisor if scheme is Scheme.SYM else divisor + lo
    ties = torch.arange(math.ceil(lo), math.floor(hi)) + 0.5
    x = torch.cat([torch.tensor([lo, hi]), ties, -ties if scheme is Scheme.SYM else ties])
    got = fused.quantize_tensor(x, spec)
    assert float(got.scale) == 1.0
    expected = torch.clamp(torch.round(x) + got.zero_point.float(), spec.qmin, spec.qmax)
    assert torch.equal(torch.from_numpy(_unpacked(got.q, spec, tuple(x.shape))).float(), expected)
    assert_same(x, spec)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_every_half_word_decodes_exactly(dtype: str) -> None:
    """All finite 16-bit words: the in-kernel decoding is the exact upcast."""
    words = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = words.view(DTYPES[dtype])
    x = x[torch.isfinite(x)][: 2**16 - 4096].reshape(-1, 512)
    for spec in (QSpec(), QSpec(Scheme.ASYM, StorageDtype.UINT8, PerTensor())):
        assert_same(x, spec)


# ---------------------------------------------------------------- bad input and misuse


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("gran", [PerChannel(0), PerTensor(), PerChannel(1), PerGroup(4)], ids=str)
def test_nonfinite_is_counted_like_torch(dtype: str, gran: Granularity) -> None:
    x = torch.zeros(4, 6)
    x[1, 2], x[3, 0], x[0, 5] = math.nan, math.inf, -math.inf
    with pytest.raises(NonFiniteInput) as err:
        fused.quantize_tensor(x.to(DTYPES[dtype]), QSpec(granularity=gran))
    assert err.value.count == 3


def test_float64_beyond_float32_is_refused_like_torch() -> None:
    x = torch.tensor([[1e300, 1.0]], dtype=torch.float64)
    with pytest.raises(NonFiniteInput) as want:
        kernels.quantize_tensor(x, QSpec())
    with pytest.raises(NonFiniteInput) as got:
        fused.quantize_tensor(x, QSpec())
    assert got.value.count == want.value.count == 0


@pytest.mark.parametrize(
    ("x", "spec"),
    [
        ([[-3e38, 3e38]], QSpec(Scheme.ASYM, StorageDtype.INT8)),
        ([[-3.4028235e38, 1.0]], QSpec()),
    ],
    ids=["range-overflow", "grid-overflow"],
)
def test_overflow_is_refused_like_torch(x: list[list[float]], spec: QSpec) -> None:
    t = torch.tensor(x)
    with pytest.raises(ValueError) as want:
        kernels.quantize_tensor(t, spec)
    with pytest.raises(ValueError) as got:
        fused.quantize_tensor(t, spec)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


@pytest.mark.parametrize(
    ("shape", "spec", "match"),
    [
        ((0, 3), QSpec(), "empty"),
        ((2, 3), QSpec(granularity=PerChannel(2)), "out of range"),
        ((), QSpec(granularity=PerTensor()), "do not cover"),
        ((4, 4), QSpec(granularity=PerTensor(), range_method=RangeMethod.MSE), "do not cover"),
    ],
    ids=["empty", "axis", "0-d", "mse-per-tensor"],
)
def test_misuse_is_a_value_error(shape: tuple[int, ...], spec: QSpec, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fused.quantize_tensor(torch.zeros(shape), spec)


def test_integer_input_is_refused() -> None:
    with pytest.raises(ValueError, match="can only quantize"):
        fused.quantize_tensor(torch.zeros(2, 2, dtype=torch.int32), QSpec())


# ---------------------------------------------------------------- dequantize


@pytest.mark.parametrize("gran", list(GRANULARITIES.values()), ids=list(GRANULARITIES))
@pytest.mark.parametrize(("scheme", "storage"), PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dequantize_matches_torch_kernels(
    out: torch.dtype, scheme: Scheme, storage: StorageDtype, gran: Granularity
) -> None:
    """Large values reach fp16's overflow to Inf and, scaled down, its subnormals."""
    x = special((6, 3, 11), seed=8) * torch.logspace(-7, 5, 11)
    spec = QSpec(scheme, storage, gran)
    qt = kernels.quantize_tensor(x, spec)
    shape = tuple(x.shape)
    want = kernels.dequantize(qt.q, qt.scale, qt.zero_point, spec, out, shape=shape)
    got = fused.dequantize_tensor(qt.q, qt.scale, qt.zero_point, spec, out, shape)
    assert got.dtype == out and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_float_to_half_rounds_like_numpy_everywhere() -> None:
    """Every exponent and the mantissa patterns next to the rounding points, fp32 -> fp16."""
    exps = np.arange(0, 256, dtype=np.uint32) << 23
    mants = np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7FFFFF], np.uint32)
    words = (exps[:, None] | mants[None, :]).reshape(-1)
    words = np.concatenate([words, words | 0x80000000])
    vals = words.view(np.float32)
    vals = vals[np.isfinite(vals)]
    n = vals.size
    ones = torch.ones(n, dtype=torch.int8)
    zeros = torch.zeros(n, dtype=torch.int8)
    spec = QSpec(Scheme.ASYM, StorageDtype.INT8, PerChannel(0))
    got = fused.dequantize_tensor(ones, torch.from_numpy(vals), zeros, spec, torch.float16, (n,))
    with np.errstate(over="ignore"):
        want = vals.astype(np.float16)
    np.testing.assert_array_equal(got.view(torch.int16).numpy(), want.view(np.int16))


def test_packed_codes_of_the_wrong_shape_are_refused() -> None:
    spec = QSpec(Scheme.SYM, StorageDtype.INT4, PerChannel(0))
    q = torch.zeros(4, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="neither"):
        fused.dequantize_tensor(q, torch.ones(4), torch.zeros(4), spec, torch.float32, (4, 9))


def test_fused_and_torch_figures_sum_the_same_chunks() -> None:
    from qtool.numerics import fused_sums, metrics

    assert fused_sums.CHUNK == metrics.CHUNK
