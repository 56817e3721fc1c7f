"""Integer ranges, qparams from a float range, and the range methods (minmax, mse search).

qparams follow docs/numerics.md ("Scales, zero points and codes") for every storage dtype:
  sym:  scale = amax / ((qmax - qmin) / 2)   (int8 [-127, 127]: / 127; int4 [-8, 7]: / 7.5)
  asym: scale = (hi - lo) / (qmax - qmin),  zero_point = clamp(qmin - round(lo / scale), qmin, qmax)
with lo = min(min(x), 0), hi = max(max(x), 0); an all-zero group gets scale 1.0 and no scale
falls below float32's smallest normal. With a narrower `scale_dtype` (bf16/fp16 storage) the
scale is rounded to it first and the zero point and codes are computed against that value.

The mse search (spec.MSE_ALGORITHM) tries, for every group, candidate ranges (lo * p, hi * p) for
a fixed list of multipliers p (`mse_candidates`), quantizes with exactly these semantics, and
keeps the candidate with the smallest sum of squared error (float32 error, squared exactly and
summed in float64). Candidate 0 is p = 1.0 (min-max) and a candidate replaces the best so far
only when its error is strictly smaller, so ties keep min-max and no group gets worse. With
column weights h (an importance matrix: h_j = E[x_j^2] of the Linear's input column j) the error
of a group is sum h_j e_j^2 instead (each e_j^2 exact in float64, times h_j in float64, summed in
float64); candidates, ties and the stored choice are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.spec import QSpec, Scheme

SMALLEST_NORMAL = torch.finfo(torch.float32).tiny
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class NonFiniteInput(ValueError):
    """The tensor holds NaN or +-Inf, which have no integer code (count None: not yet counted)."""

    def __init__(self, count: int | None = None) -> None:
        super().__init__(f"{count} NaN/Inf value(s)")
        self.count = count


@dataclass(frozen=True)
class IntRange:
    """The integer side of a scheme x storage dtype: [qmin, qmax] and the symmetric zero point."""

    qmin: int
    qmax: int
    symmetric: bool
    sym_zero_point: int

    @classmethod
    def of(cls, spec: QSpec) -> IntRange:
        """The integer side of a spec."""
        symmetric = spec.scheme is Scheme.SYM
        return cls(spec.qmin, spec.qmax, symmetric, spec.symmetric_zero_point if symmetric else 0)

    @property
    def bits(self) -> int:
        return 4 if self.qmax - self.qmin < 16 else 8


def qparams_from_range(
    lo: torch.Tensor,
    hi: torch.Tensor,
    qmin: int,
    qmax: int,
    symmetric: bool,
    sym_zero_point: int,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (scale, zero_point) of groups with minima `lo` and maxima `hi` (see module doc).

    zero_point is float32 holding an integer; scale holds a value of `scale_dtype`.
    NonFiniteInput when the range holds NaN/Inf, ValueError when hi - lo overflows float32.
    """
    scale, span, lo = _raw_scale(lo, hi, qmin, qmax, symmetric)
    if not bool(torch.isfinite(scale).all()):
        if not bool(torch.isfinite(lo).all() and torch.isfinite(hi).all()):
            raise NonFiniteInput()
        raise ValueError("value range overflows float32; quantize such tensors symmetrically")
    return _finish(scale, span, lo, qmin, qmax, symmetric, sym_zero_point, scale_dtype)


def round_scale(scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """float32 scales rounded to `scale_dtype` (to nearest), never 0 or Inf there.

    fp16 keeps subnormal scales (down to 2^-24): a tiny group is then coded against a scale
    within 1 % of its own rather than a floor 7800 times too coarse.
    """
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scales can be stored as float32, bfloat16 or float16, not {scale_dtype}")
    if scale_dtype == torch.float32:
        return scale
    info = torch.finfo(scale_dtype)
    return scale.clamp(info.tiny * info.eps, info.max).to(scale_dtype).float()


def minmax_range(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (min, max) in float32 of a block [R, S, A, L]: shape [R, S]."""
    xf = values.float()
    return xf.amin(dim=(2, 3)), xf.amax(dim=(2, 3))


def mse_candidates(r: IntRange, per_group: bool) -> tuple[float, ...]:
    """The multipliers p of the min-max range, in evaluation order (float32 values).

    1.0 (min-max) first; then n / (n + d) for d = -2.0, -1.6, .., 2.0 (d != 0), n = qmax - qmin:
    the range widened or narrowed by up to two grid steps, which moves the grid against the
    values ("alignment"; for sym int8 these are the research note's scales amax / (126 + 0.2 k),
    for asym int8 its 255 / (255 + 0.4 j)); then clip points that cut outliers: 8-bit groups
    0.98 .. 0.90 (step 0.02), 8-bit channels/tensors 0.99 .. 0.90 (step 0.01); 4-bit, where one
    step is 1/15 of the range and clipping pays more, 0.85 .. 0.60 (step 0.05) for groups and
    0.85 .. 0.30 for channels/tensors (a long row with one outlier wants a deep clip).
    """
    n = r.qmax - r.qmin
    align = [n / (n + d / 10) for d in range(-20, 21, 4) if d != 0]
    if r.bits == 8:
        clip = (
            [1 - i / 100 for i in range(2, 11, 2)]
            if per_group
            else [1 - i / 100 for i in range(1, 11)]
        )
    else:
        clip = [1 - i / 100 for i in range(15, 41 if per_group else 71, 5)]
    return tuple(float(torch.tensor(p, dtype=torch.float32)) for p in [1.0, *align, *clip])


@dataclass(frozen=True)
class SearchResult:
    """Per-group qparams chosen by the mse search, with the errors that chose them."""

    scale: torch.Tensor  # float32 [R, S]
    zero_point: torch.Tensor  # float32 [R, S], integer values
    choice: torch.Tensor  # uint8 [R, S]: index into the candidate list
    sse: torch.Tensor  # float64 [R, S]: squared error of the chosen candidate
    sse_minmax: torch.Tensor  # float64 [R, S]: squared error of min-max (candidate 0)
    minmax: tuple[torch.Tensor, torch.Tensor]  # min-max's scale and zero point (candidate 0)


def mse_search(
    values: torch.Tensor,
    r: IntRange,
    candidates: tuple[float, ...],
    scale_dtype: torch.dtype = torch.float32,
    block_elems: int = 1 << 20,
    weights: torch.Tensor | None = None,
) -> SearchResult:
    """Best candidate range per group of a block [R, S, A, L] (see module doc), slab by slab;
    `weights` (float32, broadcastable to the block; None: all 1) weigh each value's squared
    error."""
    if not candidates or candidates[0] != 1.0 or len(candidates) > 256:
        raise ValueError("candidates must start with 1.0 (min-max) and number at most 256")
    if weights is not None:
        weights = weights.expand(values.shape)  # a view: slabs index it as they index values
    lo, hi = block_range(values, block_elems)
    qp = [
        _candidate_qparams(lo, hi, p, r, scale_dtype, checked=k == 0)
        for k, p in enumerate(candidates)
    ]
    sse = torch.zeros((len(candidates), *lo.shape), dtype=torch.float64, device=values.device)
    for box in slabs(tuple(values.shape), block_elems):
        xf = values[box].float()
        w = weights[box].double() if weights is not None else None
        for k, (scale, zp) in enumerate(qp):
            idx = box[:2]
            err = quantize_error(xf, scale[idx][..., None, None], zp[idx][..., None, None], r)
            sq = err.double().square_()
            sse[k][idx] += (sq.mul_(w) if w is not None else sq).sum(dim=(2, 3))
    return _pick(qp, sse)


def block_range(
    values: torch.Tensor, block_elems: int = 1 << 20
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group float32 (min, max) of a block [R, S, A, L], one slab at a time."""
    shape = (values.shape[0], values.shape[1])
    lo = torch.full(shape, float("inf"), device=values.device)
    hi = torch.full(shape, float("-inf"), device=values.device)
    for box in slabs(tuple(values.shape), block_elems):
        s_lo, s_hi = minmax_range(values[box])
        idx = box[:2]
        lo[idx] = torch.minimum(lo[idx], s_lo)  # NaN propagates, so it is seen later
        hi[idx] = torch.maximum(hi[idx], s_hi)
    return lo, hi


def quantize_error(
    xf: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, r: IntRange
) -> torch.Tensor:
    """float32 (q - zero_point) * scale - x for q = clamp(round(x / scale) + zp, qmin, qmax)."""
    work = codes_float(xf, scale, zero_point, r)
    work.sub_(zero_point).mul_(scale)
    return work.sub_(xf)


def codes_float(
    xf: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, r: IntRange
) -> torch.Tensor:
    """clamp(round(x / scale) + zero_point, qmin, qmax) as float32 (a float32 division, RNE)."""
    work = torch.div(xf, scale)  # a division, not * (1/scale): bit-identical on CPU and CUDA
    return work.round_().add_(zero_point).clamp_(r.qmin, r.qmax)


Slab = tuple[slice, slice, slice]


def slabs(shape: tuple[int, ...], block_elems: int) -> list[Slab]:
    """Index boxes covering a block [R, S, A, L]: whole rows of about block_elems elements, or
    (for rows larger than that) runs of its A dimension; no box is smaller than one L-run."""
    rows, groups, runs, length = shape
    row_elems = groups * runs * length
    full = slice(None)
    if row_elems <= block_elems:
        step = max(1, block_elems // max(1, row_elems))
        return [(slice(i, i + step), full, full) for i in range(0, rows, step)]
    step = max(1, block_elems // max(1, groups * length))
    return [
        (slice(i, i + 1), full, slice(a, a + step))
        for i in range(rows)
        for a in range(0, runs, step)
    ]


def _raw_scale(
    lo: torch.Tensor, hi: torch.Tensor, qmin: int, qmax: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale before guards, span, lo clamped to <= 0), float32, per docs/numerics.md."""
    lo, hi = lo.float(), hi.float()
    if symmetric:
        span = torch.maximum(hi, lo.neg()).clamp_(min=0.0)  # amax over a range holding 0
        return _divide(span, (qmax - qmin) / 2), span, lo
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    span = hi - lo
    return _divide(span, qmax - qmin), span, lo


def _divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor, correctly rounded on every device: CUDA turns a division by a Python number
    into a multiplication by its reciprocal (1 ulp off for some x); by a tensor it divides."""
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def _finish(
    scale: torch.Tensor,
    span: torch.Tensor,
    lo: torch.Tensor,
    qmin: int,
    qmax: int,
    symmetric: bool,
    sym_zero_point: int,
    scale_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    # An all-zero group gets scale 1.0; no scale is ever 0 or subnormal (x / scale stays finite).
    scale = scale.clamp(min=SMALLEST_NORMAL).masked_fill_(span == 0, 1.0)
    scale = round_scale(scale, scale_dtype)
    if symmetric:
        return scale, torch.full_like(scale, sym_zero_point)
    return scale, (qmin - torch.round(lo / scale)).clamp_(qmin, qmax)


def _candidate_qparams(
    lo: torch.Tensor,
    hi: torch.Tensor,
    p: float,
    r: IntRange,
    scale_dtype: torch.dtype,
    checked: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qparams of the range (lo * p, hi * p); candidate 0 (p = 1) raises on bad input, the others
    get a NaN scale where the widened range overflows, so their error is NaN and never wins."""
    args = (r.qmin, r.qmax, r.symmetric, r.sym_zero_point)
    if checked:
        return qparams_from_range(lo, hi, *args, scale_dtype)
    scale, span, lo_c = _raw_scale(lo * p, hi * p, r.qmin, r.qmax, r.symmetric)
    bad = ~torch.isfinite(scale)
    scale, zp = _finish(
        scale.masked_fill(bad, 1.0), span, lo_c.masked_fill(bad, 0.0), *args, scale_dtype
    )
    return scale.masked_fill_(bad, float("nan")), zp


def _pick(qp: list[tuple[torch.Tensor, torch.Tensor]], sse: torch.Tensor) -> SearchResult:
    """Candidate with the smallest error per group; strictly smaller wins, so ties keep 0."""
    best = sse[0].clone()
    choice = torch.zeros(best.shape, dtype=torch.uint8, device=best.device)
    scale, zp = qp[0][0].clone(), qp[0][1].clone()
    for k in range(1, len(qp)):
        better = sse[k] < best  # NaN compares False
        best = torch.where(better, sse[k], best)
        choice.masked_fill_(better, k)
        scale, zp = torch.where(better, qp[k][0], scale), torch.where(better, qp[k][1], zp)
    return SearchResult(scale, zp, choice, best, sse[0], qp[0])
