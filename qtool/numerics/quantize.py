"""Grouped quantization in plain torch (any device): qparams per granularity and range method,
codes against the stored scale, and dequantization. No files, no printing.

Codes always satisfy q == clamp(round(x / scale) + zero_point, qmin, qmax) against the returned
(stored) scale: a float32 division, round half to even. Inputs are upcast to float32 first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.kernels import FLOAT_DTYPES
from qtool.numerics.granularity import Granularity, GroupedView
from qtool.numerics.ranges import (
    IntRange,
    RangeMethod,
    SearchResult,
    block_range,
    codes_float,
    mse_candidates,
    mse_search,
    qparams_from_range,
    slabs,
)

DEFAULT_BLOCK_ELEMS = 1 << 20


@dataclass(frozen=True)
class Quantized:
    """Codes (x's shape, one per byte) with qparams of shape granularity.qparam_shape."""

    q: torch.Tensor  # int8 (signed ranges) or uint8
    scale: torch.Tensor  # float32, holding values of the scale storage dtype
    zero_point: torch.Tensor  # the code dtype
    choice: torch.Tensor | None  # uint8 candidate index per group (mse only)
    sse: torch.Tensor | None  # float64 squared error per group of the chosen range (mse only)
    sse_minmax: torch.Tensor | None  # float64 squared error per group under min-max (mse only)


def quantize(
    x: torch.Tensor,
    granularity: Granularity,
    r: IntRange,
    method: RangeMethod = RangeMethod.MINMAX,
    *,
    scale_dtype: torch.dtype = torch.float32,
    candidates: tuple[float, ...] | None = None,
    block_elems: int = DEFAULT_BLOCK_ELEMS,
) -> Quantized:
    """Choose qparams per group (min-max or the mse search) and compute the codes."""
    x = _checked(x)
    view = granularity.view(x)
    q = torch.empty(x.shape, dtype=r.code_dtype, device=x.device)
    grids = _Grids(view.grid, x.device, method is RangeMethod.MSE)
    if method is RangeMethod.MSE and candidates is None:
        candidates = mse_candidates(r, per_group=view.grid[1] > 1)
    for block, q_block in zip(view.blocks, granularity.view(q).blocks, strict=True):
        cols = slice(block.col0, block.col0 + block.values.shape[1])
        if candidates is None:
            lo, hi = block_range(block.values, block_elems)
            args = (r.qmin, r.qmax, r.symmetric, r.sym_zero_point, scale_dtype)
            grids.scale[:, cols], grids.zero_point[:, cols] = qparams_from_range(lo, hi, *args)
        else:
            grids.put(cols, mse_search(block.values, r, candidates, scale_dtype, block_elems))
        _write_codes(block.values, q_block.values, grids, cols, r, block_elems)
    return grids.result(q, granularity.qparam_shape(tuple(x.shape)), r)


def quantize_with(
    x: torch.Tensor,
    granularity: Granularity,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    r: IntRange,
    block_elems: int = DEFAULT_BLOCK_ELEMS,
) -> torch.Tensor:
    """Codes of x against given qparams (e.g. the stored ones): values beyond them saturate."""
    x = _checked(x)
    view = granularity.view(x)
    q = torch.empty(x.shape, dtype=r.code_dtype, device=x.device)
    grids = _Grids(view.grid, x.device, False)
    grids.scale.copy_(scale.float().reshape(view.grid))
    grids.zero_point.copy_(zero_point.float().reshape(view.grid))
    for block, q_block in zip(view.blocks, granularity.view(q).blocks, strict=True):
        cols = slice(block.col0, block.col0 + block.values.shape[1])
        _write_codes(block.values, q_block.values, grids, cols, r, block_elems)
    return q


def dequantize(
    q: torch.Tensor,
    granularity: Granularity,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(q - zero_point) * scale in float32, then cast to `dtype`."""
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    view: GroupedView = granularity.view(q)
    s_grid = scale.float().reshape(view.grid)
    z_grid = zero_point.float().reshape(view.grid)
    for block, out_block in zip(view.blocks, granularity.view(out).blocks, strict=True):
        cols = slice(block.col0, block.col0 + block.values.shape[1])
        s, z = s_grid[:, cols, None, None], z_grid[:, cols, None, None]
        out_block.values.copy_((block.values.float() - z) * s)
    return out


class _Grids:
    """The [R, n] qparam grids being filled block by block."""

    def __init__(self, grid: tuple[int, int], device: torch.device, search: bool) -> None:
        self.scale = torch.empty(grid, dtype=torch.float32, device=device)
        self.zero_point = torch.empty_like(self.scale)
        self.choice = torch.empty(grid, dtype=torch.uint8, device=device) if search else None
        self.sse = torch.empty(grid, dtype=torch.float64, device=device) if search else None
        self.sse_minmax = torch.empty_like(self.sse) if self.sse is not None else None

    def put(self, cols: slice, found: SearchResult) -> None:
        assert self.choice is not None and self.sse is not None and self.sse_minmax is not None
        self.scale[:, cols], self.zero_point[:, cols] = found.scale, found.zero_point
        self.choice[:, cols], self.sse[:, cols] = found.choice, found.sse
        self.sse_minmax[:, cols] = found.sse_minmax

    def result(self, q: torch.Tensor, shape: tuple[int, ...], r: IntRange) -> Quantized:
        def shaped(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.reshape(shape)

        return Quantized(
            q=q,
            scale=self.scale.reshape(shape),
            zero_point=self.zero_point.to(r.code_dtype).reshape(shape),
            choice=shaped(self.choice),
            sse=shaped(self.sse),
            sse_minmax=shaped(self.sse_minmax),
        )


def _write_codes(
    values: torch.Tensor,
    q_values: torch.Tensor,
    grids: _Grids,
    cols: slice,
    r: IntRange,
    block_elems: int,
) -> None:
    """Codes of one block [R, S, A, L] into its view of q, slab by slab."""
    scale, zero_point = grids.scale[:, cols], grids.zero_point[:, cols]
    for box in slabs(tuple(values.shape), block_elems):
        idx = box[:2]
        s, z = scale[idx][..., None, None], zero_point[idx][..., None, None]
        q_values[box] = codes_float(values[box].float(), s, z, r).to(r.code_dtype)


def _checked(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"can only quantize float16/bfloat16/float32/float64, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError("cannot quantize an empty tensor")
    return x.contiguous()
