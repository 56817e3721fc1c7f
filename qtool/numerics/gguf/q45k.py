"""Q4_K and Q5_K: super-blocks of 256 = 8 sub-blocks of 32, each with a 6-bit scale and min.

Byte-identical to ggml's quantize_row_q4_K_ref / quantize_row_q5_K_ref (ggml-quants.c) as
llama.cpp's x86-64 release build computes them (no FMA contraction): every float operation of
the C is done in the same order with the same rounding, vectorised over all sub-blocks. The
32 elements of a sub-block run along dim 0 (element-major, `(32, S)` for S sub-blocks), so
the C's running sums are 32 vector additions in the C's order.
"""

from __future__ import annotations

import numpy as np
import torch

from qtool.gguf_types import QK_K
from qtool.numerics.gguf.cops import (
    div,
    first_greater,
    fp16_bytes,
    fp16_value,
    low_byte,
    nearest_int,
    pack_nibbles,
    seqsum,
    sqrtf,
)

_SUB = 32  # elements per sub-block
_N_SUB = QK_K // _SUB  # 8 sub-blocks per super-block


def make_qkx2_quants(
    x: torch.Tensor,
    w: torch.Tensor,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    mad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's make_qkx2_quants on every column of x, w: (n, S) (n elements per sub-block).

    Returns (scale (S,), the_min (S,), L (n, S) int32 codes 0..nmax): the weighted
    least-squares fit of x ~ scale * L - the_min over nstep + 1 candidate grids, each judged
    by its weighted squared error (`mad`: absolute error, use_mad). make_qkx3_quants with
    weights is the same function for finite x (it tests `max <= min` for `max == min`)."""
    hi, lo = x.amax(0), x.amin(0)
    lo = torch.where(lo > 0, 0.0, lo)  # (S,) the range always holds 0
    flat = hi == lo
    sum_w = seqsum(w[1:], start=w[0])
    sum_x = seqsum(w[1:] * x[1:], start=w[0] * x[0])
    iscale = div(float(nmax), hi - lo, x)
    scale = div(1.0, iscale, x)
    L = nearest_int(iscale * (x - lo)).clamp_(0, nmax)  # (32, S)
    diff = scale * L.to(torch.float32) + lo - x
    best = seqsum(w * _err(diff, mad))
    # C: iscale = (rmin + rdelta*is + nmax)/(max - min), the numerator in float32; `min` is the
    # best fit's so far, so each grid depends on the ones before it
    steps = np.arange(nstep + 1, dtype=np.float32)
    for numer in (np.float32(rmin) + np.float32(rdelta) * steps) + np.float32(nmax):
        iscale = div(float(numer), hi - lo, x)
        Laux = nearest_int(iscale * (x - lo)).clamp_(0, nmax)
        this_scale, this_min, cur, ok = _fit(x, w, Laux, sum_w, sum_x, mad)
        better = ok & (cur < best)
        L = torch.where(better, Laux, L)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        lo = torch.where(better, this_min, lo)
    L = torch.where(flat, 0, L)
    return torch.where(flat, 0.0, scale), -lo, L


def _err(diff: torch.Tensor, mad: bool) -> torch.Tensor:
    return diff.abs() if mad else diff * diff


def _fit(
    x: torch.Tensor,
    w: torch.Tensor,
    Laux: torch.Tensor,
    sum_w: torch.Tensor,
    sum_x: torch.Tensor,
    mad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The least-squares scale and min of x ~ scale * Laux + min (S,), its weighted squared
    error and whether the fit exists (D > 0), as make_qkx2_quants' loop body computes them."""
    lf = Laux.to(torch.float32)
    terms = torch.empty(lf.shape[0], 3, lf.shape[1], device=x.device)  # (32, 3, S)
    wl = torch.mul(w, lf, out=terms[:, 0])
    torch.mul(wl, lf, out=terms[:, 1])
    torch.mul(wl, x, out=terms[:, 2])
    sum_l, sum_l2, sum_xl = seqsum(terms).unbind(0)
    D = sum_w * sum_l2 - sum_l * sum_l
    this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
    this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
    clip = this_min > 0
    this_min = torch.where(clip, 0.0, this_min)
    this_scale = torch.where(clip, sum_xl / sum_l2, this_scale)
    diff = this_scale * lf + this_min - x
    return this_scale, this_min, seqsum(w * _err(diff, mad)), D > 0


def _scales_and_codes(
    blocks: torch.Tensor, nmax: int, rmin: float, nstep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (n, 16) header (d, dmin, 12 packed 6-bit scales and mins) and (n, 256) codes of
    quantize_row_q{4,5}_K_ref for float32 super-blocks (n, 256)."""
    n = blocks.shape[0]
    x = blocks.reshape(n * _N_SUB, _SUB).T.contiguous()  # (32, S)
    av_x = sqrtf(div(seqsum(x * x), 32.0, x))
    w = av_x + x.abs()
    scales, mins, L = make_qkx2_quants(x, w, nmax, rmin, 0.1, nstep)
    scales, mins = scales.view(n, _N_SUB), mins.view(n, _N_SUB)
    max_scale, max_min = first_greater(scales, 1), first_greater(mins, 1)  # (n,)
    ls = _six_bits(max_scale, scales)
    lm = _six_bits(max_min, mins)
    d, dmin = div(max_scale, 63.0, x), div(max_min, 63.0, x)
    step = fp16_value(d)[:, None] * ls.to(torch.float32)  # (n, 8)
    offset = fp16_value(dmin)[:, None] * lm.to(torch.float32)
    step, offset = step.view(-1), offset.view(-1)  # (S,)
    refit = nearest_int(div(x + offset, step, x)).clamp_(0, nmax)
    L = torch.where(step != 0, refit, L)  # C: `if (!d) continue;` keeps the first codes
    header = torch.cat([fp16_bytes(d), fp16_bytes(dmin), _pack_scales(ls, lm)], -1)
    return header, L.T.reshape(n, QK_K)


def _six_bits(top: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(n, 8) uint8 min(63, (uint8)nearest_int(63/top * value)), 0 where top is 0."""
    inv = torch.where(top > 0, div(63.0, top, top), 0.0)[:, None]
    return low_byte(nearest_int(inv * values)).clamp_(max=63)


def _pack_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """(n, 12): sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins);
    sub-blocks 4-7 as nibbles in bytes 8-11 with their top 2 bits above bytes 0-7's."""
    lo_s, hi_s, lo_m, hi_m = ls[:, :4], ls[:, 4:], lm[:, :4], lm[:, 4:]
    return torch.cat(
        [lo_s | ((hi_s >> 4) << 6), lo_m | ((hi_m >> 4) << 6), pack_nibbles(hi_s, hi_m)], -1
    )


def quantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 144): d, dmin, scales[12], qs[128] (byte 32c + l: code 64c + l | 64c + 32 + l)."""
    header, L = _scales_and_codes(blocks, 15, -1.0, 20)
    q = L.view(-1, 4, 2, _SUB)  # (n, chunk of 64, low/high nibble, 32)
    return torch.cat([header, pack_nibbles(q[:, :, 0], q[:, :, 1]).flatten(1)], -1)


def quantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 176): d, dmin, scales[12], qh[32] (bit j of byte l: bit 4 of code 32j + l), qs[128]."""
    header, L = _scales_and_codes(blocks, 31, -0.5, 15)
    q = L.view(-1, 4, 2, _SUB)
    shifts = torch.arange(_N_SUB, dtype=torch.int32, device=L.device).view(1, 4, 2, 1)
    qh = ((q >> 4) << shifts).sum((1, 2)).to(torch.uint8)  # (n, 32)
    return torch.cat([header, qh, pack_nibbles(q[:, :, 0], q[:, :, 1]).flatten(1)], -1)
