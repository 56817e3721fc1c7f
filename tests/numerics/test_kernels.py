from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from qtool.numerics import kernels
from qtool.spec import QSpec, Scheme, StorageDtype
from tests import reference
from tests.specs import qspec

BYTES = (StorageDtype.INT8, StorageDtype.UINT8)
SPECS = [qspec(s, d, a) for s in Scheme for d in BYTES for a in (None, 0, 1, -1)]


def spec_id(spec: QSpec) -> str:
    where = "tensor" if spec.axis is None else f"axis{spec.axis}"
    return f"{spec.scheme.value}-{spec.dtype.value}-{where}"


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().float().numpy()


# ---- golden vectors, derived by hand --------------------------------------------------------


def _f32(value: Fraction | float) -> Fraction:
    """Round to the nearest float32, as an exact fraction."""
    return Fraction(float(np.float32(float(value))))


def _rne(value: Fraction) -> int:
    """Round half to even on an exact rational."""
    floor = value.numerator // value.denominator
    rest = value - floor
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and floor % 2):
        return floor + 1
    return floor


def test_golden_symmetric_int8_by_hand() -> None:
    # x = [-1.0, 0.3, 2.0]: amax = 2, scale = fl32(2/127), q = rne(fl32(x / scale))
    xs = [_f32(-1.0), _f32(0.3), _f32(2.0)]
    scale = _f32(Fraction(2, 127))
    expected = [_rne(_f32(x / scale)) for x in xs]
    assert expected == [-64, 19, 127]  # the golden vector docs/numerics.md gives
    result = kernels.quantize_tensor(torch.tensor([[-1.0, 0.3, 2.0]]), qspec(axis=None))
    assert result.q.tolist() == [expected]
    assert Fraction(float(result.scale)) == scale
    assert int(result.zero_point) == 0


def test_golden_affine_uint8_by_hand() -> None:
    # lo = -1, hi = 2: scale = fl32(3/255), zp = 0 - rne(lo / scale) = 85
    xs = [_f32(-1.0), _f32(0.3), _f32(2.0)]
    scale = _f32(_f32(3.0) / 255)
    zero_point = -_rne(_f32(xs[0] / scale))
    expected = [min(255, max(0, _rne(_f32(x / scale)) + zero_point)) for x in xs]
    assert (zero_point, expected) == (85, [0, 111, 255])
    spec = qspec(Scheme.ASYM, StorageDtype.UINT8, None)
    result = kernels.quantize_tensor(torch.tensor([-1.0, 0.3, 2.0]), spec)
    assert result.q.tolist() == expected
    assert Fraction(float(result.scale)) == scale
    assert int(result.zero_point) == 85


def test_symmetric_uint8_is_int8_shifted_by_128() -> None:
    x = torch.tensor([-1.0, 0.3, 2.0])
    signed = kernels.quantize_tensor(x, qspec(axis=None)).q.to(torch.int16)
    unsigned = kernels.quantize_tensor(x, qspec(Scheme.SYM, StorageDtype.UINT8, None)).q
    assert (unsigned.to(torch.int16) - signed).tolist() == [128, 128, 128]


# ---- bit-exact agreement with the plain reference ------------------------------------------


def _realistic(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 0.02
    x.view(-1)[:: max(1, x.numel() // 7)] *= 30  # outliers
    if x.ndim >= 2:
        x[0] = 0.0  # an all-zero channel
        x[-1] = x[-1].abs() + 0.5  # a channel whose range excludes 0
    return x.to(dtype)


SHAPES = [(7, 5), (64, 33), (3, 4, 5), (2, 3, 4, 5), (1, 9, 2), (300, 1)]


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_codes_match_reference_bit_for_bit(
    spec: QSpec, shape: tuple[int, ...], dtype: torch.dtype, device: str
) -> None:
    x = _realistic(shape, dtype, seed=len(shape) * 100 + shape[0])
    axis = None if spec.axis is None else spec.axis % len(shape)
    ref_q, ref_scale, ref_zp = reference.quantize(_np(x), spec.scheme.value, spec.dtype.value, axis)
    # Tiny blocks exercise every slab layout; the default exercises the one-block case.
    for block in (kernels.DEFAULT_BLOCK_ELEMS, 16, 5):
        result = kernels.quantize_tensor(x.to(device), spec, block_elems=block)
        np.testing.assert_array_equal(result.q.cpu().numpy(), ref_q)
        np.testing.assert_array_equal(result.scale.cpu().numpy(), ref_scale)
        np.testing.assert_array_equal(result.zero_point.cpu().numpy(), ref_zp)


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_unfused_api_matches_fused(spec: QSpec, device: str) -> None:
    x = _realistic((33, 17), torch.float32, seed=3).to(device)
    scale, zero_point = kernels.compute_qparams(x, spec)
    fused = kernels.quantize_tensor(x, spec)
    assert torch.equal(kernels.quantize(x, scale, zero_point, spec), fused.q)
    assert torch.equal(scale, fused.scale) and torch.equal(zero_point, fused.zero_point)


@pytest.mark.parametrize("scheme", list(Scheme))
@pytest.mark.parametrize("dtype", BYTES)
def test_agrees_with_torch_quantize_per_channel_except_at_ties(
    scheme: Scheme, dtype: StorageDtype
) -> None:
    """torch's CPU kernel multiplies by 1/scale where qtool divides: the two may differ by one
    code exactly where x/scale is (within float32 rounding) a tie k + 0.5, and nowhere else."""
    x = _realistic((256, 512), torch.float32, seed=11)
    spec = qspec(scheme, dtype, 0)
    ours = kernels.quantize_tensor(x, spec)
    qtype = torch.qint8 if dtype is StorageDtype.INT8 else torch.quint8
    theirs = torch.quantize_per_channel(
        x, ours.scale.double(), ours.zero_point.long(), 0, qtype
    ).int_repr()
    diff = ours.q.to(torch.int16) - theirs.to(torch.int16)
    mismatched = diff != 0
    assert diff.abs().max() <= 1
    ratio = (x / ours.scale[:, None])[mismatched]
    assert torch.allclose(ratio.abs().frac(), torch.tensor(0.5), atol=1e-4)
    assert mismatched.float().mean() < 1e-3


# ---- degenerate groups ----------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_all_zero_tensor_gets_scale_one_and_exact_zeros(spec: QSpec, device: str) -> None:
    x = torch.zeros(4, 6, device=device)
    result = kernels.quantize_tensor(x, spec)
    assert bool((result.scale == 1.0).all())
    x_hat = kernels.dequantize(result.q, result.scale, result.zero_point, spec)
    assert torch.equal(x_hat, x)
    assert result.errors is not None and result.errors.sqnr_db == float("inf")


@pytest.mark.parametrize("scheme", list(Scheme))
def test_denormal_only_channel_gets_smallest_normal_scale(scheme: Scheme) -> None:
    x = torch.tensor([[1e-40, -2e-41, 0.0], [1.0, -0.5, 0.25]])
    result = kernels.quantize_tensor(x, qspec(scheme, StorageDtype.INT8, 0))
    assert float(result.scale[0]) == torch.finfo(torch.float32).tiny
    assert bool(
        torch.isfinite(kernels.dequantize(result.q, result.scale, result.zero_point, qspec())).all()
    )


def test_constant_positive_tensor_keeps_zero_in_range() -> None:
    x = torch.full((3, 4), 3.0)
    spec = qspec(Scheme.ASYM, StorageDtype.UINT8, None)
    result = kernels.quantize_tensor(x, spec)
    assert int(result.zero_point) == 0
    x_hat = kernels.dequantize(result.q, result.scale, result.zero_point, spec)
    assert torch.equal(x_hat, x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_nonfinite_values_are_refused_with_a_count(bad: float, axis: int | None) -> None:
    x = torch.ones(4, 5)
    x[1, 2] = bad
    x[3, 0] = bad
    with pytest.raises(kernels.NonFiniteInput) as info:
        kernels.quantize_tensor(x, qspec(axis=axis))
    assert info.value.count == 2


def test_range_beyond_float32_is_refused_for_affine_only() -> None:
    x = torch.tensor([[-3e38, 3e38]])
    with pytest.raises(ValueError, match="overflows float32"):
        kernels.quantize_tensor(x, qspec(Scheme.ASYM, StorageDtype.INT8, None))
    result = kernels.quantize_tensor(x, qspec(axis=None))
    assert result.q.tolist() == [[-127, 127]]


def test_misuse_raises_value_error() -> None:
    with pytest.raises(ValueError, match="float"):
        kernels.quantize_tensor(torch.ones(2, 2, dtype=torch.int32), QSpec())
    with pytest.raises(ValueError, match="out of range"):
        kernels.quantize_tensor(torch.ones(2, 2), qspec(axis=2))
    with pytest.raises(ValueError, match="empty"):
        kernels.quantize_tensor(torch.ones(0, 2), qspec(axis=None))


def test_input_is_never_modified(device: str) -> None:
    x = _realistic((40, 30), torch.float32, seed=5).to(device)
    before = x.clone()
    for spec in SPECS:
        kernels.quantize_tensor(x, spec, block_elems=64)
    assert torch.equal(x, before)


# ---- properties -----------------------------------------------------------------------------

finite32 = st.floats(-(2.0**100), 2.0**100, width=32)
matrices = arrays(np.float32, array_shapes(min_dims=1, max_dims=3, max_side=6), elements=finite32)


def _axis_for(spec: QSpec, ndim: int) -> int | None:
    return None if spec.axis is None or ndim < 2 else spec.axis % ndim


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
@given(x=matrices)
def test_properties(spec: QSpec, x: np.ndarray) -> None:
    """Codes in [qmin, qmax]; 0.0 <-> zero_point exactly; |x - x_hat| <= scale/2 inside the
    representable range; quantize(dequantize(q)) == q; scales finite and normal."""
    axis = _axis_for(spec, x.ndim)
    spec = qspec(spec.scheme, spec.dtype, axis)
    x[..., 0] = 0.0  # every group holds an exact zero
    t = torch.from_numpy(x)
    try:
        result = kernels.quantize_tensor(t, spec, block_elems=7)
    except ValueError as err:  # only an affine range wider than float32 may be refused
        assert "overflows" in str(err) and spec.scheme is Scheme.ASYM
        return
    q, scale, zp = result.q, result.scale, result.zero_point
    assert int(q.min()) >= spec.qmin and int(q.max()) <= spec.qmax
    assert bool(torch.isfinite(scale).all()) and bool((scale >= torch.finfo().tiny).all())
    x_hat = kernels.dequantize(q, scale, zp, spec)
    shape = [1] * t.ndim
    if axis is not None:
        shape[axis] = -1
    s = scale.reshape(shape)
    z = zp.float().reshape(shape)
    zero = t == 0
    assert torch.equal(q[zero].float(), z.expand_as(t)[zero])
    assert bool((x_hat[zero] == 0).all())
    inside = (t >= (spec.qmin - z) * s) & (t <= (spec.qmax - z) * s)
    bound = (s * 0.5).expand_as(t) * (1 + 1e-6) + t.abs() * 1e-7
    assert bool(((t - x_hat).abs() <= bound)[inside].all())
    assert torch.equal(kernels.quantize(x_hat, scale, zp, spec), q)


@given(x=arrays(np.float32, (5, 8), elements=st.floats(-10, 10, width=32)))
def test_codes_survive_a_round_trip_through_floats(x: np.ndarray) -> None:
    """With the same qparams, re-quantizing a reconstruction gives back the same codes (fresh
    qparams need not: affine zero-point rounding moves the reconstructed range)."""
    spec = qspec(Scheme.ASYM, StorageDtype.INT8, 1)
    first = kernels.quantize_tensor(torch.from_numpy(x), spec)
    x_hat = kernels.dequantize(first.q, first.scale, first.zero_point, spec)
    assert torch.equal(kernels.quantize(x_hat, first.scale, first.zero_point, spec), first.q)


def test_dequantize_restores_requested_dtype() -> None:
    x = _realistic((8, 8), torch.bfloat16, seed=9)
    result = kernels.quantize_tensor(x, QSpec())
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        assert (
            kernels.dequantize(result.q, result.scale, result.zero_point, qspec(), dtype).dtype
            == dtype
        )


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_quantize_with_foreign_qparams_clamps_to_the_range(spec: QSpec) -> None:
    """quantize() takes any qparams: values beyond their range saturate at qmin/qmax."""
    x = torch.tensor([[-5.0, -0.01, 0.0, 0.02, 7.0], [3.0, -3.0, 1.0, 0.5, -0.25]])
    axis = None if spec.axis is None else spec.axis % 2
    shape = () if axis is None else (x.shape[axis],)
    scale = torch.full(shape, 0.01)
    zero_point = torch.full(shape, 3 if spec.dtype is StorageDtype.INT8 else 130)
    q = kernels.quantize(x, scale, zero_point.to(kernels.TORCH_STORAGE[spec.dtype]), spec)
    ref = np.clip(np.round(x.numpy() / np.float32(0.01)) + int(zero_point.flatten()[0]),
                  spec.qmin, spec.qmax)  # fmt: skip
    np.testing.assert_array_equal(q.numpy(), ref)


@pytest.mark.parametrize(
    "shape",
    [(1, 1, 2**31 + 17), (3, 2**20 + 1, 5), (2, 7, 2**22 + 3), (1000, 3, 2)],
    ids=["over-2^31-per-tensor", "many-channels", "huge-rows", "small"],
)
def test_slabs_cover_every_element_once_in_memory_order(shape: tuple[int, int, int]) -> None:
    """The slab walk (pure index arithmetic, Python ints) is exact beyond 2^31 elements."""
    pre, channels, post = shape
    position = 0
    for i0, i1, c0, c1, p0, p1 in kernels._slabs(shape, 1 << 21):
        start = (i0 * channels + c0) * post + p0
        assert start == position
        size = (i1 - i0) * (c1 - c0) * (p1 - p0)
        assert size <= max(1 << 21, channels * post if c1 - c0 == channels else post)
        position += size
    assert position == pre * channels * post


# ---- reconstructions near the float32 limit -------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_a_causal_mask_never_dequantizes_to_infinity(spec: QSpec) -> None:
    # finfo(float32).min is finite, but sym's amax / 127 * 127 rounds above float32's max.
    mask = torch.full((4, 4), torch.finfo(torch.float32).min).triu(1)
    if spec.scheme is Scheme.SYM:
        with pytest.raises(ValueError, match="reconstruction would overflow"):
            kernels.quantize_tensor(mask, spec)
        return
    result = kernels.quantize_tensor(mask, spec)
    x_hat = kernels.dequantize(result.q, result.scale, result.zero_point, spec)
    assert bool(x_hat.isfinite().all()) and result.errors is not None and result.errors.finite


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_near_limit_values_that_fit_give_finite_reconstructions(spec: QSpec) -> None:
    x = torch.tensor([[1.6e38, -0.5e38], [0.5e38, -1.6e38]])  # asym: hi - lo fits float32
    result = kernels.quantize_tensor(x, spec)
    x_hat = kernels.dequantize(result.q, result.scale, result.zero_point, spec)
    assert bool(x_hat.isfinite().all())
    assert result.errors is not None and result.errors.finite
    assert result.errors.sqnr_db > 30
