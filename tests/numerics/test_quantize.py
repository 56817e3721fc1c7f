from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from qtool.numerics import kernels
from qtool.numerics.ranges import IntRange, mse_candidates
from qtool.spec import Granularity, PerChannel, PerGroup, PerTensor, RangeMethod
from tests import reference
from tests.adapters import (
    INT_RANGES,
    dequantize,
    int_range,
    per_group_candidates,
    quantize,
    quantize_with,
    spec_of,
)

RANGES = list(INT_RANGES)  # (scheme, dtype) for int8, uint8, int4, uint4
INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _ref_granularity(granularity: Granularity, ndim: int) -> tuple[str, int]:
    if isinstance(granularity, PerTensor):
        return ("tensor", 0)
    if isinstance(granularity, PerChannel):
        return ("channel", granularity.axis % ndim)
    return ("group", granularity.size)


def _realistic(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 0.02
    x.view(-1)[:: max(1, x.numel() // 7)] *= 30  # outliers
    if x.ndim >= 2:
        x[0] = 0.0  # an all-zero channel (and all-zero groups)
        x[-1] = x[-1].abs() + 0.5  # a channel whose range excludes 0
    return x.to(dtype)


# (shape, granularity): channels on several axes, groups dividing K and not, G >= K.
CONFIGS: list[tuple[tuple[int, ...], Granularity]] = [
    *[((6, 8), g) for g in (PerTensor(), PerChannel(0), PerChannel(1), PerGroup(4), PerGroup(3))],
    *[((3, 4, 5), g) for g in (PerTensor(), PerChannel(0), PerChannel(1), PerChannel(-1))],
    *[((3, 4, 5), g) for g in (PerGroup(5), PerGroup(6), PerGroup(64))],
    *[((5, 2, 3, 2), g) for g in (PerChannel(2), PerGroup(4), PerGroup(2))],
    ((9,), PerTensor()),
    ((9,), PerChannel(0)),
]


def _cid(config: tuple[tuple[int, ...], Granularity]) -> str:
    return f"{'x'.join(map(str, config[0]))}-{config[1].describe().replace(' ', '')}"


def _check_against_reference(
    x: torch.Tensor, granularity: Granularity, key: tuple[str, str], device: str, **kw: object
) -> None:
    method = kw.get("method", "minmax")
    scale_dtype = str(kw.get("scale_dtype", "float32"))
    r = int_range(*key)
    candidates = list(
        mse_candidates(r, per_group=per_group_candidates(granularity, tuple(x.shape)))
    )
    ref_q, ref_s, ref_z, ref_k = reference.quantize_v2(
        x.float().numpy(), *key, _ref_granularity(granularity, x.ndim), str(method),
        candidates, scale_dtype,
    )  # fmt: skip
    for block in (1 << 20, 3):  # tiny slabs exercise the row and run splits
        got = quantize(
            x.to(device), granularity, r, RangeMethod(method),
            scale_dtype=SCALE_DTYPES[scale_dtype], block_elems=block,
        )  # fmt: skip
        np.testing.assert_array_equal(got.q.cpu().numpy().astype(np.int64), ref_q)
        np.testing.assert_array_equal(got.scale.cpu().numpy(), ref_s)
        np.testing.assert_array_equal(got.zero_point.cpu().numpy().astype(np.int64), ref_z)
        if method == "mse":
            assert got.choice is not None
            np.testing.assert_array_equal(got.choice.cpu().numpy().astype(np.int64), ref_k)


@pytest.mark.parametrize("key", RANGES, ids=["-".join(k) for k in RANGES])
@pytest.mark.parametrize("config", CONFIGS, ids=[_cid(c) for c in CONFIGS])
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_minmax_matches_reference_bit_for_bit(
    key: tuple[str, str],
    config: tuple[tuple[int, ...], Granularity],
    dtype: torch.dtype,
    device: str,
) -> None:
    shape, granularity = config
    x = _realistic(shape, dtype, seed=len(shape) * 100 + shape[0])
    _check_against_reference(x, granularity, key, device)


MSE_CONFIGS = [c for c in CONFIGS if c[0] != (9,)]


@pytest.mark.parametrize("key", RANGES, ids=["-".join(k) for k in RANGES])
@pytest.mark.parametrize("config", MSE_CONFIGS, ids=[_cid(c) for c in MSE_CONFIGS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_mse_matches_reference_bit_for_bit(
    key: tuple[str, str],
    config: tuple[tuple[int, ...], Granularity],
    dtype: torch.dtype,
    device: str,
) -> None:
    shape, granularity = config
    x = _realistic(shape, dtype, seed=7 + shape[0])
    _check_against_reference(x, granularity, key, device, method="mse")


SCALE_CASES = list(itertools.product(["bfloat16", "float16"], ["minmax", "mse"]))


@pytest.mark.parametrize("key", RANGES, ids=["-".join(k) for k in RANGES])
@pytest.mark.parametrize("case", SCALE_CASES, ids=["-".join(c) for c in SCALE_CASES])
def test_narrow_scale_dtypes_match_reference(
    key: tuple[str, str], case: tuple[str, str], device: str
) -> None:
    scale_dtype, method = case
    x = _realistic((6, 10), torch.float32, seed=4)
    x[1, :3] = torch.tensor([1e-6, -3e-7, 2e-6])  # a group whose fp16 scale is subnormal
    for granularity in (PerChannel(0), PerGroup(3)):
        _check_against_reference(
            x, granularity, key, device, method=method, scale_dtype=scale_dtype
        )


@pytest.mark.parametrize("key", RANGES, ids=["-".join(k) for k in RANGES])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_codes_are_computed_against_the_stored_scale(
    key: tuple[str, str], scale_dtype: torch.dtype, device: str
) -> None:
    """The scale is a value of its storage dtype, and the codes are exactly those of that
    scale (not of the float32 scale before rounding)."""
    x = _realistic((16, 64), torch.float32, seed=8).to(device)
    r = int_range(*key)
    for method in RangeMethod:
        got = quantize(x, PerGroup(16), r, method, scale_dtype=scale_dtype)
        assert torch.equal(got.scale.to(scale_dtype).float(), got.scale)
        assert bool((got.scale > 0).all() and torch.isfinite(got.scale).all())
        assert torch.equal(quantize_with(x, PerGroup(16), got.scale, got.zero_point, r), got.q)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_narrow_scales_never_become_zero_or_infinite(scale_dtype: torch.dtype) -> None:
    x = torch.tensor([[1e-30, -1e-31], [3e38, -1e38]])
    got = quantize(x, PerChannel(0), int_range("sym", "int8"), scale_dtype=scale_dtype)
    assert bool((got.scale > 0).all() and torch.isfinite(got.scale).all())
    assert got.scale[1] == torch.finfo(scale_dtype).max or scale_dtype == torch.bfloat16


@pytest.mark.parametrize("key", [("sym", "int8"), ("sym", "uint8")], ids=["int8", "uint8"])
def test_codes_are_clamped_when_the_narrow_scale_rounds_down(
    key: tuple[str, str], device: str
) -> None:
    """An fp16 scale can lie well below amax / 127 (its subnormals keep few bits; 65504 caps
    it), so amax / scale passes qmax: the codes clamp to it instead of wrapping around."""
    amax = torch.arange(1, 1024, dtype=torch.int16).view(torch.float16).float()
    x = torch.cat([torch.stack([amax, -amax], dim=1), torch.tensor([[1e30, -1e30]])])
    for granularity in (PerChannel(0), PerGroup(2)):
        _check_against_reference(x, granularity, key, device, scale_dtype="float16")


# ---- golden vectors, derived by hand ----------------------------------------------------------


def _f32(value: Fraction | float) -> Fraction:
    """Round to the nearest float32, as an exact fraction."""
    return Fraction(float(np.float32(float(value))))


def _rne(value: Fraction) -> int:
    floor = value.numerator // value.denominator
    rest = value - floor
    return floor + 1 if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and floor % 2) else floor


def test_golden_symmetric_int4_groups_with_a_shorter_last_group() -> None:
    # x = [1.5, -0.6 | 0.9, 3.0 | -0.2], G = 2 (K = 5: two groups of 2, then a group of 1),
    # sym int4: [qmin, qmax] = [-8, 7], scale = amax / 7.5, zero point 0.
    #   group 0: amax 1.5 -> scale f32(0.2); 1.5 / f32(0.2) = 7.4999999 rounds (float32) to 7.5,
    #            RNE 8, clamped to 7 (the half-step clip of +amax); -0.6 / 0.2 = -3.0 -> -3
    #   group 1: amax 3.0 -> scale f32(0.4); 0.9 / 0.4 = 2.25 -> 2; 3.0 / 0.4 = 7.5 -> 8 -> 7
    #   group 2: amax 0.2 -> scale f32(f32(0.2) / 7.5); -0.2 / scale = -7.5 -> RNE -8 (in range:
    #            the full 4-bit range represents -amax exactly)
    xs = [_f32(v) for v in (1.5, -0.6, 0.9, 3.0, -0.2)]
    scales = [
        _f32(xs[0] / Fraction(15, 2)),
        _f32(xs[3] / Fraction(15, 2)),
        _f32(-xs[4] / Fraction(15, 2)),
    ]
    group_of = [0, 0, 1, 1, 2]
    codes = [max(-8, min(7, _rne(_f32(x / scales[g])))) for x, g in zip(xs, group_of, strict=True)]
    assert codes == [7, -3, 2, 7, -8]
    assert scales[:2] == [_f32(0.2), _f32(0.4)]
    got = quantize(
        torch.tensor([[1.5, -0.6, 0.9, 3.0, -0.2]]), PerGroup(2), int_range("sym", "int4")
    )
    assert got.q.tolist() == [codes]
    assert [Fraction(float(s)) for s in got.scale[0]] == scales
    assert got.zero_point.tolist() == [[0, 0, 0]]


def test_golden_eight_bit_values_agree_with_design_md() -> None:
    x = torch.tensor([-1.0, 0.3, 2.0])
    sym = quantize(x, PerTensor(), int_range("sym", "int8"))
    asym = quantize(x, PerTensor(), int_range("asym", "uint8"))
    assert sym.q.tolist() == [-64, 19, 127] and int(sym.zero_point) == 0
    assert asym.q.tolist() == [0, 111, 255] and int(asym.zero_point) == 85


# ---- properties -------------------------------------------------------------------------------

finite32 = st.floats(-(2.0**60), 2.0**60, width=32)
arrays_nd = arrays(np.float32, array_shapes(min_dims=1, max_dims=3, max_side=7), elements=finite32)
GRANULARITIES = [PerTensor(), PerChannel(0), PerChannel(-1), PerGroup(2), PerGroup(3)]


def _per_element(grid: np.ndarray, x: np.ndarray, granularity: Granularity) -> np.ndarray:
    """Broadcast a qparam grid onto x's elements (via the reference's group index lists)."""
    groups, _ = reference.groups_of(x, _ref_granularity(granularity, x.ndim))
    out = np.empty(x.size, dtype=np.float64)
    flat_grid = np.asarray(grid, dtype=np.float64).reshape(-1)
    for i, members in enumerate(m for row in groups for m in row):
        out[members] = flat_grid[i]
    return out.reshape(x.shape)


@pytest.mark.parametrize("key", RANGES, ids=["-".join(k) for k in RANGES])
@given(x=arrays_nd, which=st.sampled_from(GRANULARITIES))
def test_minmax_properties(key: tuple[str, str], x: np.ndarray, which: Granularity) -> None:
    """Codes in [qmin, qmax]; 0.0 <-> zero point exactly; |x - x_hat| <= scale / 2 inside the
    representable range; re-quantizing x_hat with the same qparams gives the same codes."""
    r = int_range(*key)
    x.reshape(-1)[::3] = 0.0
    t = torch.from_numpy(x)
    try:
        got = quantize(t, which, r)
    except ValueError as err:  # only an affine range wider than float32 may be refused
        assert "overflows" in str(err) and not r.symmetric
        return
    q = got.q.numpy().astype(np.int64)
    assert q.min() >= r.qmin and q.max() <= r.qmax
    x_hat = dequantize(got.q, which, got.scale, got.zero_point).numpy()
    s = _per_element(got.scale.numpy(), x, which)
    z = _per_element(got.zero_point.numpy(), x, which)
    zero = x == 0
    assert (q[zero] == z[zero]).all() and (x_hat[zero] == 0).all()
    inside = (x >= (r.qmin - z) * s) & (x <= (r.qmax - z) * s)
    err = np.abs(x.astype(np.float64) - x_hat)
    assert (err <= s * 0.5 * (1 + 1e-6) + np.abs(x) * 1e-7)[inside].all()
    assert torch.equal(
        quantize_with(torch.from_numpy(x_hat), which, got.scale, got.zero_point, r), got.q
    )


def _group_sse(x: np.ndarray, x_hat: np.ndarray, granularity: Granularity) -> list[float]:
    groups, _ = reference.groups_of(x, _ref_granularity(granularity, x.ndim))
    err = (x_hat.astype(np.float64) - x.astype(np.float64)).reshape(-1)
    return [float(np.sum(err[m] ** 2)) for row in groups for m in row]


@pytest.mark.parametrize("key", RANGES, ids=["-".join(k) for k in RANGES])
@given(x=arrays_nd, which=st.sampled_from(GRANULARITIES))
def test_mse_is_never_worse_than_minmax_in_any_group(
    key: tuple[str, str], x: np.ndarray, which: Granularity
) -> None:
    """Per group, the squared error of the mse choice <= that of min-max (the search picks by
    float64 sums in its own order; re-summed here, equal errors may differ by a few ulps)."""
    r = int_range(*key)
    t = torch.from_numpy(x)
    try:
        base = quantize(t, which, r)
    except ValueError:
        return
    best = quantize(t, which, r, RangeMethod.MSE)
    sse_base = _group_sse(x, dequantize(base.q, which, base.scale, base.zero_point).numpy(), which)
    sse_best = _group_sse(x, dequantize(best.q, which, best.scale, best.zero_point).numpy(), which)
    for b, m in zip(sse_base, sse_best, strict=True):
        assert m <= b * (1 + 1e-12)
    assert best.choice is not None
    same = best.choice == 0
    assert torch.equal(best.scale[same], base.scale[same])


@pytest.mark.parametrize("key", RANGES, ids=["-".join(k) for k in RANGES])
def test_mse_keeps_minmax_on_exact_ties(key: tuple[str, str]) -> None:
    """Groups min-max codes without error (all zeros; values on the min-max grid, which sym
    4-bit cannot have as +amax always clips by half a step): nothing is strictly better."""
    r = int_range(*key)
    levels = torch.arange(r.qmin, r.qmax + 1, dtype=torch.float32)
    zp = r.sym_zero_point if r.symmetric else r.qmin
    rows = [torch.zeros_like(levels)]
    if not (r.symmetric and r.bits == 4):
        rows.append((levels - zp) * 0.25)
    got = quantize(torch.stack(rows), PerChannel(0), r, RangeMethod.MSE)
    assert got.choice is not None and got.choice.tolist() == [0] * len(rows)


def test_mse_clips_an_outlier_row_and_reports_the_gain() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4096, generator=gen)
    x[:, 7] = 12.0  # one large outlier per row
    r = int_range("sym", "int4")
    got = quantize(x, PerChannel(0), r, RangeMethod.MSE)
    assert got.choice is not None and bool((got.choice > 0).all())
    stats = kernels.quantize_tensor(x, spec_of(r, PerChannel(0), RangeMethod.MSE)).errors
    assert stats is not None and stats.mse_gain is not None and stats.mse_gain < -0.2


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("method", list(RangeMethod), ids=lambda m: m.value)
def test_nonfinite_input_is_refused(bad: float, method: RangeMethod) -> None:
    from qtool.numerics.ranges import NonFiniteInput

    x = torch.ones(4, 6)
    x[2, 3] = bad
    with pytest.raises(NonFiniteInput):
        quantize(x, PerGroup(3), int_range("sym", "int4"), method)


def test_misuse_raises_value_error() -> None:
    r: IntRange = int_range("sym", "int8")
    with pytest.raises(ValueError, match="float"):
        quantize(torch.ones(2, 2, dtype=torch.int32), PerTensor(), r)
    with pytest.raises(ValueError, match="empty"):
        quantize(torch.ones(0, 2), PerTensor(), r)
    with pytest.raises(ValueError, match="unknown scheme"):
        int_range("sym", "int2")


def test_input_is_never_modified(device: str) -> None:
    x = _realistic((12, 10), torch.float32, seed=5).to(device)
    before = x.clone()
    for key, granularity, method in itertools.product(RANGES, GRANULARITIES, RangeMethod):
        quantize(x, granularity, int_range(*key), method, block_elems=7)
    assert torch.equal(x, before)
