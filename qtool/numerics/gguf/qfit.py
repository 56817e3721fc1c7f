"""The scale fits of ggml's quantizers with an importance matrix (ggml-quants.c), in torch.

Layout as q45k: the n elements of a group along dim 0, the groups side by side, `(n, S)`;
every float operation of the C in its order and rounding (no FMA contraction), so the C's
sequential loops over a group's elements are loops of vector operations here.
"""

from __future__ import annotations

import torch

from qtool.numerics.gguf.cops import const, div, low_byte, nearest_int, seqsum, sqrtf
from qtool.numerics.gguf.q6k import GROUP_MAX_EPS, signed_absmax

_TRIES = 5  # make_qp_quants' and make_q3_quants' refinement passes


def make_qp_quants(
    x: torch.Tensor, qw: torch.Tensor, nmax: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's make_qp_quants(n, nmax, x, L, qw) on every column of x, qw (n, S): the scale of
    the non-negative values x (a super-block's sub-block scales or mins) on a grid 0..nmax.

    Returns (scale (S,), L (n, S) int32 0..255: the C's uint8 codes). The C's refinement
    changes one code at a time in element order; a pass that changes nothing would change
    nothing again, so passes run here on every column until the C's five."""
    top = torch.zeros_like(x[0])
    for v in x:
        top = torch.where(top > v, top, v)  # C: MAX(max, x[i])
    empty = top < const(GROUP_MAX_EPS, x)
    iscale = div(float(nmax), top, x)
    L = low_byte(nearest_int(iscale * x)).to(torch.int32)
    scale = div(1.0, iscale, x)
    diff = x - scale * L.to(torch.float32)
    best = seqsum((qw * diff) * diff)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        numer = torch.tensor(step, dtype=torch.float32) * torch.tensor(0.1) + float(nmax)
        iscale_is = div(numer.to(x.device), top, x)
        scale_is = div(1.0, iscale_is, x)
        lf = nearest_int(iscale_is * x).clamp_(max=nmax).to(torch.float32)
        diff = x - scale_is * lf
        mse = seqsum((qw * diff) * diff)
        better = mse < best
        best = torch.where(better, mse, best)
        iscale = torch.where(better, iscale_is, iscale)
    li = nearest_int(iscale * x).clamp_(max=nmax)
    L = low_byte(li).to(torch.int32)
    lf = li.to(torch.float32)
    sumlx = seqsum((qw * x) * lf)
    suml2 = seqsum((qw * lf) * lf)
    for _ in range(_TRIES):
        for i in range(x.shape[0]):
            w, xi, old = qw[i], x[i], L[i].to(torch.float32)
            slx = sumlx - (w * xi) * old
            sl2 = suml2 - (w * old) * old
            new = nearest_int(div(xi * sl2, slx, x)).clamp_(max=nmax)
            nf = new.to(torch.float32)
            slx = slx + (w * xi) * nf
            sl2 = sl2 + (w * nf) * nf
            take = (
                (sumlx - (w * xi) * old > 0)
                & (suml2 - (w * old) * old > 0)
                & (new != L[i])
                & ((slx * slx) * suml2 > (sumlx * sumlx) * sl2)
            )
            L[i] = torch.where(take, low_byte(new).to(torch.int32), L[i])
            sumlx = torch.where(take, slx, sumlx)
            suml2 = torch.where(take, sl2, suml2)
    scale = torch.where(suml2 > 0, div(sumlx, suml2, x), 0.0)
    return torch.where(empty, 0.0, scale), torch.where(empty, 0, L)


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's make_q3_quants(n, nmax, x, L, do_rmse=true) on every column of x (n, S): the
    x^2-weighted fit of quantize_row_q3_K_ref. Returns (scale (S,), L (n, S) 0..2 nmax - 1)."""
    top, amax = signed_absmax(x)
    empty = amax < const(GROUP_MAX_EPS, x)
    iscale = div(float(-nmax), top, x)
    L = nearest_int(iscale * x).clamp_(-nmax, nmax - 1)
    w = x * x
    lf = L.to(torch.float32)
    sumlx = seqsum((w * x) * lf)
    suml2 = seqsum((w * lf) * lf)
    for _ in range(_TRIES):
        for i in range(x.shape[0]):
            wi, xi, old = w[i], x[i], L[i].to(torch.float32)
            slx0 = sumlx - (wi * xi) * old
            sl2 = suml2 - (wi * old) * old
            new = nearest_int(div(xi * sl2, slx0, x)).clamp_(-nmax, nmax - 1)
            nf = new.to(torch.float32)
            slx = slx0 + (wi * xi) * nf
            sl2 = sl2 + (wi * nf) * nf
            take = (
                (slx0 > 0)
                & (new != L[i])
                & (sl2 > 0)
                & ((slx * slx) * suml2 > (sumlx * sumlx) * sl2)
            )
            L[i] = torch.where(take, new, L[i])
            sumlx = torch.where(take, slx, sumlx)
            suml2 = torch.where(take, sl2, suml2)
    scale = torch.where(suml2 > 0, div(sumlx, suml2, x), 0.0)
    return torch.where(empty, 0.0, scale), torch.where(empty, 0, L + nmax)


def sigma2_weights(x: torch.Tensor, qw: torch.Tensor, sigma2: torch.Tensor) -> torch.Tensor:
    """The C's `qw[l] * sqrtf(sigma2 + x[l]*x[l])`: x, qw (n, S), sigma2 (S,)."""
    return qw * sqrtf(sigma2 + x * x)


def mean_square(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """`scale * (sum of x*x in order) / n` over the last dim of rows (..., n) as the C writes
    sigma2 (`sum_x2/n` or `2*sum_x2/QK_K`: scale 1 or 2, the product before the quotient)."""
    n = rows.shape[-1]
    acc = torch.zeros(rows.shape[:-1], dtype=torch.float32, device=rows.device)
    for j in range(n):
        col = rows[..., j]
        acc.add_(col * col)
    if scale != 1:
        acc = const(scale, rows) * acc
    return div(acc, float(n), rows)
