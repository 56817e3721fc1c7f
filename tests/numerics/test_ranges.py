from __future__ import annotations

import numpy as np
import pytest
import torch

from qtool.numerics import range_methods
from qtool.numerics.ranges import (
    IntRange,
    mse_candidates,
    mse_search,
    qparams_from_range,
    round_scale,
)
from qtool.spec import Scheme, StorageDtype
from tests import reference
from tests.adapters import INT_RANGES, int_range
from tests.specs import qspec

EIGHT_BIT = [(s, d) for s in Scheme for d in (StorageDtype.INT8, StorageDtype.UINT8)]


def _ranges(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group minima/maxima with the awkward cases: zeros, denormals, one-sided, equal ends."""
    gen = torch.Generator().manual_seed(seed)
    lo = -torch.rand(n, generator=gen) * torch.logspace(-40, 30, n)
    hi = torch.rand(n, generator=gen) * torch.logspace(30, -40, n)
    lo[:4], hi[:4] = torch.tensor([0.0, 1e-40, 0.5, -2.0]), torch.tensor([0.0, 2e-40, 0.5, -1.0])
    return lo, hi


@pytest.mark.parametrize("key", EIGHT_BIT, ids=[f"{s.value}-{d.value}" for s, d in EIGHT_BIT])
def test_eight_bit_qparams_are_bit_identical_to_the_kernels(
    key: tuple[Scheme, StorageDtype], device: str
) -> None:
    scheme, dtype = key
    spec = qspec(scheme, dtype, 0)
    r = int_range(scheme, dtype)
    assert (r.qmin, r.qmax) == (spec.qmin, spec.qmax)
    lo, hi = (t.to(device) for t in _ranges(2000, seed=1))
    old_scale, old_zp = range_methods.qparams_from_range(lo, hi, spec)
    new_scale, new_zp = qparams_from_range(
        lo, hi, r.qmin, r.qmax, r.symmetric, spec.symmetric_zero_point
    )
    assert torch.equal(new_scale, old_scale)
    assert torch.equal(new_zp, old_zp)


@pytest.mark.parametrize("key", list(INT_RANGES), ids=["-".join(k) for k in INT_RANGES])
def test_qparams_match_the_reference_for_every_dtype(key: tuple[str, str]) -> None:
    r = int_range(*key)
    lo, hi = _ranges(300, seed=2)
    scale, zp = qparams_from_range(lo, hi, r.qmin, r.qmax, r.symmetric, r.sym_zero_point)
    for i in range(300):
        ref_scale, ref_zp = reference.qparams_v2(np.array([lo[i], hi[i]], dtype=np.float32), *key)
        assert (float(scale[i]), int(zp[i])) == (float(ref_scale), ref_zp)


def test_four_bit_formulas_by_hand() -> None:
    # amax 3: sym int4 scale 3 / 7.5 = 0.4; asym [-1, 2]: scale 3 / 15 = 0.2, zp -8 - (-5) = -3
    one = torch.tensor([-1.0]), torch.tensor([2.0])
    sym = qparams_from_range(torch.tensor([-3.0]), torch.tensor([1.0]), -8, 7, True, 0)
    asym = qparams_from_range(*one, -8, 7, False, 0)
    uasym = qparams_from_range(*one, 0, 15, False, 8)
    assert (float(sym[0]), float(sym[1])) == (float(np.float32(0.4)), 0.0)
    assert (float(asym[0]), float(asym[1])) == (float(np.float32(0.2)), -3.0)
    assert float(uasym[1]) == 5.0


def test_ranges_table() -> None:
    assert INT_RANGES[("sym", "int4")] == IntRange(-8, 7, True, 0)
    assert INT_RANGES[("sym", "uint4")] == IntRange(0, 15, True, 8)
    assert sorted(r.bits for r in INT_RANGES.values()) == [4, 4, 4, 4, 8, 8, 8, 8]
    assert int_range(Scheme.ASYM, StorageDtype.UINT8) == IntRange(0, 255, False, 0)


@pytest.mark.parametrize(
    "scale_dtype, value, expected",
    [
        (torch.bfloat16, 1.0 + 2**-8, 1.0),  # a tie: to even
        (torch.bfloat16, 1.0 + 3 * 2**-9, 1.0 + 2**-7),
        (torch.float16, 1e-9, 2.0**-24),  # would round to 0: the smallest subnormal instead
        (torch.float16, 1e6, 65504.0),  # would round to inf: the largest finite instead
        (torch.float16, 3e-6, float(np.float16(3e-6))),  # subnormal kept
        (torch.float32, 0.1, float(np.float32(0.1))),
    ],
    ids=["bf16-tie", "bf16-up", "fp16-underflow", "fp16-overflow", "fp16-subnormal", "fp32"],
)
def test_round_scale(scale_dtype: torch.dtype, value: float, expected: float) -> None:
    got = round_scale(torch.tensor([value]), scale_dtype)
    assert got.dtype == torch.float32 and float(got[0]) == expected
    assert (
        float(reference.to_scale_dtype(np.float32(value), str(scale_dtype).removeprefix("torch.")))
        == expected
    )


def test_round_scale_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        round_scale(torch.ones(1), torch.float64)


def test_candidate_lists_follow_their_documented_formula() -> None:
    f32 = np.float32
    sym8 = mse_candidates(int_range("sym", "int8"), per_group=True)
    # alignment: amax * p / 127 == amax / (126 + 0.2 k), the research note's sym int8 scales
    assert [f32(p) / f32(127) for p in sym8[1:11]] == pytest.approx(
        [1 / (126 + 0.2 * k) for k in range(11) if k != 5], rel=1e-6
    )
    assert sym8[0] == 1.0 and sym8[11:] == tuple(
        float(f32(p)) for p in (0.98, 0.96, 0.94, 0.92, 0.90)
    )
    asym8 = mse_candidates(int_range("asym", "uint8"), per_group=False)
    assert asym8[1:11] == pytest.approx(
        [255 / (255 + 0.4 * j) for j in range(-5, 6) if j], rel=1e-7
    )
    assert asym8[11:] == tuple(float(f32(1 - i / 100)) for i in range(1, 11))
    four = mse_candidates(int_range("asym", "int4"), per_group=True)
    assert four[1:11] == pytest.approx(
        [15 / (15 + d / 10) for d in range(-20, 21, 4) if d], rel=1e-7
    )
    assert four[11:] == tuple(float(f32(p)) for p in (0.85, 0.8, 0.75, 0.7, 0.65, 0.6))
    four_ch = mse_candidates(int_range("sym", "uint4"), per_group=False)
    assert four_ch[11:] == tuple(float(f32(1 - i / 100)) for i in range(15, 71, 5))
    assert four_ch[-1] == float(f32(0.3)) and len(four_ch) == 23
    for cands in (sym8, asym8, four):
        assert all(float(f32(p)) == p for p in cands) and len(set(cands)) == len(cands)


def test_search_refuses_a_list_without_minmax_first() -> None:
    x = torch.ones(2, 1, 1, 4)
    with pytest.raises(ValueError, match="start with 1.0"):
        mse_search(x, int_range("sym", "int8"), (0.9, 1.0))
    with pytest.raises(ValueError, match="at most 256"):
        mse_search(x, int_range("sym", "int8"), (1.0,) * 257)


def test_widened_candidates_that_overflow_never_win() -> None:
    x = torch.tensor([[-3.3e38, 3.3e38, 1e38, 0.0]]).view(1, 1, 1, 4)
    r = int_range("sym", "int8")
    found = mse_search(x, r, mse_candidates(r, per_group=False))
    assert bool(torch.isfinite(found.scale).all()) and bool(torch.isfinite(found.sse).all())


@pytest.mark.parametrize(
    ("qmin", "qmax", "symmetric"), [(-127, 127, True), (-8, 7, True), (0, 255, False)]
)
def test_scales_are_correctly_rounded_divisions_on_every_device(
    device: str, qmin: int, qmax: int, symmetric: bool
) -> None:
    # A multiplication by the divisor's reciprocal (what CUDA makes of a division by a Python
    # number) is 1 ulp off for about 1 amax in 16 at int8 and 1 in 2 at int4: these ranges
    # catch it, on the CPU as on CUDA.
    torch.manual_seed(0)
    hi = torch.rand(4096, device=device) * 3
    lo = -torch.rand(4096, device=device) * (3 if not symmetric else 1)
    scale, _ = qparams_from_range(lo, hi, qmin, qmax, symmetric, 0)
    span = torch.maximum(hi, -lo) if symmetric else hi - lo
    divisor = (qmax - qmin) / 2 if symmetric else qmax - qmin
    assert torch.equal(scale.cpu(), (span.double() / divisor).float().cpu())
