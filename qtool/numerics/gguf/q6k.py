"""Q6_K: super-blocks of 256 = 16 sub-blocks of 16, 6-bit codes, an 8-bit scale per sub-block.

Byte-identical to ggml's quantize_row_q6_K_ref as llama.cpp's x86-64 release build computes it
(no FMA contraction); layout as q45k: the 16 elements of a sub-block along dim 0, `(16, S)`.
"""

from __future__ import annotations

import numpy as np
import torch

from qtool.gguf_types import QK_K
from qtool.numerics.gguf.cops import (
    const,
    div,
    fp16_bytes,
    fp16_value,
    low_byte,
    nearest_int,
    pack_nibbles,
    seqsum,
)

_SUB = 16
_N_SUB = QK_K // _SUB
_NMAX = 32
GROUP_MAX_EPS = 1e-15  # ggml-quants.c: a group below this magnitude is all zero


def make_qx_quants(
    x: torch.Tensor, nmax: int = _NMAX, qw: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's make_qx_quants(n, nmax, x, L, rmse_type=1, qw) on every column of x: (n, S).

    Returns (scale (S,), L (n, S) int32 codes 0..2 nmax - 1): the least-squares scale over 19
    grids weighted by qw (n, S), or by x^2 without it; 0 and codes 0 for a column whose
    largest |x| is below 1e-15."""
    top, amax = signed_absmax(x)
    empty = amax < const(GROUP_MAX_EPS, x)
    L = _codes(div(float(-nmax), top, x), x, nmax)  # (16, S)
    w = x * x if qw is None else qw
    first_lx, first_l2 = _sums(x, L[:, None], w)
    sumlx, suml2 = first_lx[0], first_l2[0]
    scale = torch.where(suml2 != 0, div(sumlx, suml2, x), 0.0)
    best = scale * sumlx
    steps = np.array([i for i in range(-9, 10) if i], dtype=np.float32)
    numer = -(np.float32(nmax) + np.float32(0.1) * steps)  # C: -(nmax + 0.1f*is), in float32
    iscales = div(torch.from_numpy(numer).to(x.device)[:, None], top, x)  # (18, S)
    Ls = _codes(iscales, x[:, None], nmax)  # (16, 18, S)
    all_lx, all_l2 = _sums(x, Ls, w)
    for k in range(len(steps)):
        lx, l2 = all_lx[k], all_l2[k]
        better = (l2 > 0) & (lx * lx > best * l2)
        L = torch.where(better, Ls[:, k], L)
        scale = torch.where(better, lx / l2, scale)
        best = torch.where(better, scale * lx, best)
    return torch.where(empty, 0.0, scale), torch.where(empty, 0, L + nmax)


def signed_absmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S,) the first x of largest magnitude along dim 0, signed, and that magnitude, as C's
    `if (ax > amax) { amax = ax; max = x[i]; }` scan from 0 finds them: a NaN is never taken
    (torch's max would propagate one, which an overflowed weight can give)."""
    top = torch.zeros_like(x[0])
    amax = torch.zeros_like(top)
    for v in x:
        ax = v.abs()
        greater = ax > amax
        top = torch.where(greater, v, top)
        amax = torch.where(greater, ax, amax)
    return top, amax


def _codes(iscale: torch.Tensor, x: torch.Tensor, nmax: int) -> torch.Tensor:
    """clamp(nearest_int(iscale * x), -nmax, nmax - 1), signed codes."""
    return nearest_int(iscale * x).clamp_(-nmax, nmax - 1)


def _sums(x: torch.Tensor, L: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, S) running sums of w*x*l and w*l*l over the n elements in order."""
    lf = L.to(torch.float32)  # (n, K, S)
    w = w[:, None]
    sums = seqsum(torch.stack([(w * x[:, None]) * lf, (w * lf) * lf], 2))  # (K, 2, S)
    return sums[:, 0], sums[:, 1]


def quantize_q6_k(blocks: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """(n, 210): ql[128], qh[64], scales[16] (int8), d; all zero for a block below 1e-15.
    With quant_weights qw (n, 256) it is quantize_row_q6_K_impl: each sub-block's scale fitted
    with those weights (ggml leaves its x-dependent weighting commented out)."""
    n = blocks.shape[0]
    x = blocks.reshape(n * _N_SUB, _SUB).T.contiguous()  # (16, S)
    w = None if qw is None else qw.reshape(n * _N_SUB, _SUB).T.contiguous()
    scales, L = make_qx_quants(x, _NMAX, w)
    scales = scales.view(n, _N_SUB)
    top, top_abs = _largest_scale(scales)  # (n,)
    iscale = div(-128.0, top, x)
    d = div(1.0, iscale, x)
    sc = low_byte(nearest_int(iscale[:, None] * scales).clamp_(max=127))  # (n, 16) int8 bytes
    step = (fp16_value(d)[:, None] * sc.view(torch.int8).to(torch.float32)).view(-1)  # (S,)
    refit = nearest_int(div(x, step, x)).clamp_(-32, 31) + 32
    L = torch.where(step != 0, refit, L).T.reshape(n, QK_K)  # C: `if (!d) continue;`
    out = torch.cat([_pack_codes(L), sc, fp16_bytes(d)], -1)
    return torch.where((top_abs < const(GROUP_MAX_EPS, x))[:, None], 0, out)


def _largest_scale(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first scale of largest magnitude (signed) and that magnitude, C's strict `>` scan
    from 0 (NaN never taken)."""
    top = torch.zeros_like(scales[:, 0])
    top_abs = torch.zeros_like(top)
    for s in scales.unbind(1):
        greater = s.abs() > top_abs
        top = torch.where(greater, s, top)
        top_abs = torch.where(greater, s.abs(), top_abs)
    return top, top_abs


def _pack_codes(L: torch.Tensor) -> torch.Tensor:
    """(n, 192): ql[128] then qh[64] of codes (n, 256) 0..63. Per half of 128 (c) and l < 32:
    ql[64c + l] = L[128c + l] | L[128c + 64 + l] << 4, ql[64c + 32 + l] the same from
    L[128c + 32 + l] and L[128c + 96 + l]; qh[32c + l] holds their bits 4-5 at 0, 2, 4, 6."""
    q = L.view(-1, 2, 4, 32)  # (n, half, quarter, l)
    ql = torch.cat([pack_nibbles(q[:, :, 0], q[:, :, 2]), pack_nibbles(q[:, :, 1], q[:, :, 3])], -1)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=L.device).view(1, 1, 4, 1)
    qh = ((q >> 4) << shifts).sum(2).to(torch.uint8)  # (n, 2, 32)
    return torch.cat([ql.flatten(1), qh.flatten(1)], -1)
