"""Range methods: the step between "find the range" and "compute the codes", one small object per
method (as optimum-quanto's optimizers): each turns the float32 values of groups into their
qparams. The kernels (numerics/kernels.py) walk the tensor and ask the method for each slab.

  MinMax     [min(x, 0), max(x, 0)] as it is (docs/numerics.md, "Scales, zero points and codes").
  MseSearch  the candidate range with the least squared error (numerics/ranges.mse_search);
             it also keeps, for the report, the min-max qparams of the groups it last searched
             (the kernels measure the error min-max would have had). Given ColumnWeights (an
             importance matrix's h per input column), the least activation-weighted error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qtool.numerics import ranges
from qtool.numerics.ranges import IntRange
from qtool.numerics.views import channel_range, search_view
from qtool.spec import PerGroup, QSpec, RangeMethod, matrix_shape, qparam_shape

Qparams = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # scale, zero point, choice


class GridOverflow(ValueError):
    """The qparams' extreme codes would dequantize to +-inf."""


def check_grid_finite(scale: torch.Tensor, zero_point: torch.Tensor, spec: QSpec) -> None:
    """Refuse qparams whose extreme codes dequantize to +-inf: amax / 127 * 127 can round
    above float32's largest value (a causal mask filled with finfo(float32).min does)."""
    reach = torch.maximum((spec.qmax - zero_point).abs(), (spec.qmin - zero_point).abs())
    if not math.isfinite(float((reach * scale).amax())):
        raise GridOverflow(
            "values reach the float32 limit (about 3.4e38, e.g. a mask filled with "
            "finfo(float32).min): their reconstruction would overflow to infinity; "
            "exclude this tensor to keep it as it is"
        )


def qparams_from_range(
    lo: torch.Tensor, hi: torch.Tensor, spec: QSpec, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (scale, zero_point) for groups whose minima are `lo` and maxima `hi`; zero_point
    is float32 holding an integer (cast by the caller for storage). See ranges."""
    r = IntRange.of(spec)
    scale, zero_point = ranges.qparams_from_range(
        lo, hi, r.qmin, r.qmax, r.symmetric, r.sym_zero_point, scale_dtype
    )
    check_grid_finite(scale, zero_point, spec)
    return scale, zero_point


def search_candidates(spec: QSpec, shape: tuple[int, ...]) -> tuple[float, ...]:
    """The multipliers the mse search tries for a tensor of `shape`, in order (() for min-max):
    groups shorter than a row use the group list, whole rows and tensors the channel list."""
    if spec.range_method is not RangeMethod.MSE:
        return ()
    g = spec.granularity
    per_group = isinstance(g, PerGroup) and g.size < matrix_shape(shape)[1]
    return ranges.mse_candidates(IntRange.of(spec), per_group)


@dataclass(frozen=True)
class ColumnWeights:
    """A weight h per input column of a tensor's [C, K] matrix view (numerics/views.py):
    `h` float32 [1 or C, W] with W dividing K; value (r, c) weighs h[r or 0, c % W]. A 2-D
    Linear [out, in]: [1, in]; stacked experts [E, out, in] (matrix rows are experts): [E, in]."""

    h: torch.Tensor
    source: str = ""  # the importance matrix's file name, for messages

    def __post_init__(self) -> None:
        if self.h.ndim != 2 or self.h.dtype != torch.float32 or 0 in self.h.shape:
            raise ValueError("column weights must be a non-empty float32 [n_mat, K] tensor")

    def check(self, shape: tuple[int, ...]) -> None:
        """ValueError unless these weights fit a tensor of `shape`."""
        c, k = matrix_shape(shape)
        n, w = self.h.shape
        if k % w or n not in (1, c):
            raise ValueError(f"column weights [{n}, {w}] do not fit a tensor of shape {shape}")

    def rows(self, r0: int, r1: int) -> ColumnWeights:
        """The weights of rows r0:r1 of the matrix view (a slab of the tensor's first dim)."""
        return self if self.h.shape[0] == 1 else ColumnWeights(self.h[r0:r1], self.source)

    def to(self, device: torch.device) -> ColumnWeights:
        return ColumnWeights(self.h.to(device), self.source)

    def block(self, r0: int, r1: int, a: int, b: int) -> torch.Tensor:
        """Weights of rows r0:r1, columns a:b of the matrix view: [r1 - r0 or 1, b - a]."""
        h = self.h if self.h.shape[0] == 1 else self.h[r0:r1]
        w = h.shape[1]
        if a // w == (b - 1) // w:  # within one input row: a view
            return h[:, a % w : a % w + (b - a)]
        cols = torch.arange(a, b, device=h.device).remainder_(w)
        return h[:, cols]

    def full(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The weights of every value of a tensor of `shape`, in that shape (a copy)."""
        c, k = matrix_shape(shape)
        return self.block(0, c, 0, k).expand(c, k).contiguous().view(shape)


class MinMax:
    """Each group's own range. With float32 scales every value lies inside its group's grid,
    so codes need no clamp (`exact`); a scale rounded to fp16 can be far below amax / 127
    (subnormal scales keep few bits; 65504 caps it), so |x / scale| may pass qmax."""

    searching = False

    def __init__(self, spec: QSpec, scale_dtype: torch.dtype) -> None:
        self.spec, self.scale_dtype = spec, scale_dtype
        self.exact = scale_dtype == torch.float32

    def groups(self, xf: torch.Tensor, weights: torch.Tensor | None = None) -> Qparams:
        """qparams of the groups of a float32 slab (rows, groups, L): each (rows, groups);
        min-max takes no weights."""
        lo, hi = xf.amin(dim=2), xf.amax(dim=2)  # (aminmax with dim= is ~10x slower)
        return (*qparams_from_range(lo, hi, self.spec, self.scale_dtype), None)

    def whole(self, x: torch.Tensor, weights: ColumnWeights | None = None) -> Qparams:
        """qparams per tensor or per channel on any axis, in the qparam shape."""
        lo, hi = channel_range(x, self.spec)
        return (*qparams_from_range(lo, hi, self.spec, self.scale_dtype), None)


class MseSearch:
    """The candidate range per group with the least squared error (ties keep min-max), with
    the index of the candidate each group kept; `minmax` holds the min-max qparams of the groups
    searched last (as `groups` or `whole` returns them). A clipped range clips values: codes are
    always clamped."""

    searching = True
    exact = False

    def __init__(
        self, spec: QSpec, candidates: tuple[float, ...], scale_dtype: torch.dtype, block_elems: int
    ) -> None:
        self.spec, self.candidates = spec, candidates
        self.scale_dtype, self.block_elems = scale_dtype, block_elems
        self.int_range = IntRange.of(spec)
        self.minmax: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def groups(self, xf: torch.Tensor, weights: torch.Tensor | None = None) -> Qparams:
        """As MinMax.groups, searched; `weights` [rows or 1, groups, L] weigh the errors."""
        w = weights.unsqueeze(2) if weights is not None else None
        return self._search(xf.unsqueeze(2), w)

    def whole(self, x: torch.Tensor, weights: ColumnWeights | None = None) -> Qparams:
        """As MinMax.whole, searched (weighted: the weights are expanded to x's shape)."""
        shape = qparam_shape(self.spec.granularity, tuple(x.shape))
        w = search_view(weights.full(tuple(x.shape)), self.spec) if weights is not None else None
        scale, zero_point, choice = self._search(search_view(x, self.spec), w)
        assert choice is not None
        self.minmax = (self.minmax[0].reshape(shape), self.minmax[1].reshape(shape))
        return scale.reshape(shape), zero_point.reshape(shape), choice.reshape(shape)

    def _search(self, values: torch.Tensor, weights: torch.Tensor | None) -> Qparams:
        found = ranges.mse_search(
            values, self.int_range, self.candidates, self.scale_dtype, self.block_elems, weights
        )
        check_grid_finite(found.scale, found.zero_point, self.spec)
        self.minmax = found.minmax
        return found.scale, found.zero_point, found.choice


RangeMethodImpl = MinMax | MseSearch


def range_method(
    spec: QSpec, shape: tuple[int, ...], scale_dtype: torch.dtype, block_elems: int
) -> RangeMethodImpl:
    """The object that carries out `spec.range_method` on a tensor of `shape`."""
    candidates = search_candidates(spec, shape)
    if not candidates:
        return MinMax(spec, scale_dtype)
    return MseSearch(spec, candidates, scale_dtype, block_elems)
