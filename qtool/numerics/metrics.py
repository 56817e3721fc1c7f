"""Error statistics of a reconstruction: pure torch, any device, no I/O.

mse = mean((x - x_hat)^2), max_abs = max|x - x_hat|,
sqnr_db = 10 log10(sum x^2 / sum (x - x_hat)^2), +inf when the error is exactly 0.
Element-wise work is float32 (the semantics' precision); squares and sums are float64, so
values near the float32 limit (1e17, 1e20, finfo.max) give finite, exact-enough figures.
"""

from __future__ import annotations

import math

import torch

from qtool.results import ErrorStats

SQUARES_CHUNK = 1 << 19  # elements upcast to float64 at a time (4 MiB, reused)


class ErrorAccumulator:
    """Sums over the slabs of one tensor, kept as Python floats (float64)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._sq_err = 0.0
        self._sq_signal = 0.0
        self._max_abs = 0.0
        self._numel = 0

    def add(self, x: torch.Tensor, error: torch.Tensor) -> None:
        """Account for one slab: x its values, error = x - x_hat (float32 or float64)."""
        x1, e1 = x.reshape(-1), error.reshape(-1)
        if x1.numel() == 0:
            return
        # aminmax runs ~15x faster than vector_norm(e, inf) on CPU (torch 2.13).
        lo, hi = torch.aminmax(e1)
        self._sq_err += self._sum_of_squares(e1)
        self._sq_signal += self._sum_of_squares(x1)
        slab_max = float(torch.maximum(hi, lo.neg()))  # torch.maximum propagates NaN
        if math.isnan(slab_max) or math.isnan(self._max_abs):
            self._max_abs = math.nan  # sticky: a NaN must never look like a small error
        else:
            self._max_abs = max(self._max_abs, slab_max)
        self._numel += x1.numel()

    def _sum_of_squares(self, v: torch.Tensor) -> float:
        """sum v^2 with squares and sum in float64 (a float32 square overflows at 1.8e19 and
        underflows below 1e-19; float32 accumulation drifts by ~1e-3 over millions of terms).
        Torch's reductions with a dtype upcast their whole input first, so chunks are upcast
        into one reused buffer and summed by a float64 dot (BLAS): no slab-sized temporary."""
        n = v.numel()
        buf = self._buf
        if buf is None or buf.numel() < min(n, SQUARES_CHUNK) or buf.device != v.device:
            buf = self._buf = torch.empty(
                min(n, SQUARES_CHUNK), dtype=torch.float64, device=v.device
            )
        parts = []
        for i in range(0, n, SQUARES_CHUNK):
            chunk = v[i : i + SQUARES_CHUNK]
            b = buf[: chunk.numel()]
            b.copy_(chunk)
            parts.append(torch.dot(b, b))
        return float(torch.stack(parts).sum())

    def result(self) -> ErrorStats:
        return ErrorStats(
            numel=self._numel,
            sq_error=self._sq_err,
            sq_signal=self._sq_signal,
            max_abs=self._max_abs,
        )


def error_stats(x: torch.Tensor, x_hat: torch.Tensor, block_elems: int = 1 << 20) -> ErrorStats:
    """Compare an original with its reconstruction (both upcast to float32), slab by slab.

    When a float32 difference overflows (finite values of opposite sign near the float32 limit),
    the tensor is measured again in float64, so finite inputs always give finite figures.
    """
    if x.shape != x_hat.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs {tuple(x_hat.shape)}")
    stats = _accumulate(x, x_hat, torch.float32, block_elems)
    if math.isinf(stats.max_abs) and _all_finite(x) and _all_finite(x_hat):
        stats = _accumulate(x, x_hat, torch.float64, block_elems)
    return stats


def _accumulate(
    x: torch.Tensor, x_hat: torch.Tensor, dtype: torch.dtype, block_elems: int
) -> ErrorStats:
    acc = ErrorAccumulator()
    x1, y1 = x.reshape(-1), x_hat.reshape(-1)
    for start in range(0, x1.numel(), block_elems):
        xs = x1[start : start + block_elems].to(dtype)
        acc.add(xs, xs - y1[start : start + block_elems].to(dtype))
    return acc.result()


def _all_finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


def count_nonfinite(t: torch.Tensor) -> int:
    """How many NaN/Inf values t holds (0 for integer tensors)."""
    return int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
