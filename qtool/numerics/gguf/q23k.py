"""Q2_K and Q3_K: super-blocks of 256 = 16 sub-blocks of 16, 2- and 3-bit codes.

Byte-identical to ggml's quantize_row_q{2,3}_K_ref and, given quant_weights, to
quantize_row_q{2,3}_K_impl (ggml-quants.c) as llama.cpp's x86-64 release build computes them
(no FMA contraction); layout as q45k: the 16 elements of a sub-block along dim 0, `(16, S)`.
"""

from __future__ import annotations

import torch

from qtool.gguf_types import QK_K
from qtool.numerics.gguf.cops import (
    div,
    first_greater,
    fp16_bytes,
    fp16_value,
    low_byte,
    nearest_int,
    seqsum,
)
from qtool.numerics.gguf.q6k import make_qx_quants
from qtool.numerics.gguf.q45k import make_qkx2_quants
from qtool.numerics.gguf.qfit import make_q3_quants, make_qp_quants, mean_square, sigma2_weights

_SUB = 16
_N_SUB = QK_K // _SUB  # 16 sub-blocks per super-block


def _lanes(t: torch.Tensor) -> torch.Tensor:
    """(n, 256) -> (16, 16 n): element i of sub-block j of block b at [i, 16 b + j]."""
    return t.reshape(-1, _SUB).T.contiguous()


def _pack_2bit(L: torch.Tensor) -> torch.Tensor:
    """(n, 64) qs of codes (n, 256) 0..3: byte 32 h + l holds codes 128 h + 32 k + l at 2 k."""
    q = L.to(torch.uint8).view(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).flatten(1)


def _refit(x: torch.Tensor, step: torch.Tensor, offset: torch.Tensor, L: torch.Tensor,
           lo: int, hi: int) -> torch.Tensor:  # fmt: skip
    """The C's requantization to the stored scales: nearest_int((x + offset) / step) clamped,
    where step (S,) is non-zero (`if (!d) continue;` keeps the first codes)."""
    refit = nearest_int(div(x + offset, step, x)).clamp_(lo, hi) - lo
    return torch.where(step != 0, refit, L)


def _q2_k_bytes(n: int, x: torch.Tensor, L: torch.Tensor, sc: torch.Tensor,
                d: torch.Tensor, dmin: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """(n, 84): scales[16], qs[64], d, dmin, codes refitted to the scales (n, 16) as stored."""
    step = (fp16_value(d)[:, None] * (sc & 0xF).to(torch.float32)).reshape(-1)
    offset = (fp16_value(dmin)[:, None] * (sc >> 4).to(torch.float32)).reshape(-1)
    L = _refit(x, step, offset, L, 0, 3).T.reshape(n, QK_K)
    return torch.cat([sc, _pack_2bit(L), fp16_bytes(d), fp16_bytes(dmin)], -1)


def quantize_q2_k(blocks: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """(n, 84) of float32 super-blocks (n, 256); quant_weights qw (n, 256) for the _impl."""
    n = blocks.shape[0]
    x = _lanes(blocks)
    if qw is None:
        scales, mins, L = make_qkx2_quants(x, x.abs(), 3, -0.5, 0.1, 15, mad=True)
        scales, mins = scales.view(n, _N_SUB), mins.view(n, _N_SUB)
        max_scale, max_min = first_greater(scales, 1), first_greater(mins, 1)
        ls = _four_bits(max_scale, scales)
        lm = _four_bits(max_min, mins)
        sc = low_byte(ls | (lm << 4))
        return _q2_k_bytes(n, x, L, sc, div(max_scale, 15.0, x), div(max_min, 15.0, x))
    sigma2 = mean_square(blocks, 1.0).repeat_interleave(_N_SUB)  # (S,)
    w = sigma2_weights(x, _lanes(qw), sigma2)
    sw = seqsum(w).view(n, _N_SUB).T  # (16, n) per super-block
    scales, mins, L = make_qkx2_quants(x, w, 3, -0.9, 0.05, 36)
    dm, Ls = make_qp_quants(scales.view(n, _N_SUB).T.contiguous(), sw, 15)
    mm, Lm = make_qp_quants(mins.view(n, _N_SUB).T.contiguous(), sw, 15)
    sc = low_byte(Ls.T | (Lm.T << 4))
    return _q2_k_bytes(n, x, L, sc, dm, mm)


def _four_bits(top: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(n, 16) int32 nearest_int(15/top * value), 0 where top is not positive."""
    inv = torch.where(top > 0, div(15.0, top, top), 0.0)[:, None]
    return torch.where(top[:, None] > 0, nearest_int(inv * values), 0)


def _q3_k_bytes(n: int, x: torch.Tensor, L: torch.Tensor, ls: torch.Tensor,
                d: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """(n, 110): hmask[32], qs[64], scales[12], d; ls (n, 16) the 6-bit scales 0..63."""
    step = (fp16_value(d)[:, None] * (ls - 32).to(torch.float32)).reshape(-1)
    L = _refit(x, step, torch.zeros_like(step), L, -4, 3).T.reshape(n, QK_K)  # 0..7
    high = (L > 3).to(torch.uint8).view(n, 8, 32)  # bit k of hmask[m]: code 32 k + m
    shifts = torch.arange(8, dtype=torch.uint8, device=L.device).view(1, 8, 1)
    hmask = (high << shifts).sum(1, dtype=torch.int32).to(torch.uint8)
    qs = _pack_2bit(L & 3)
    b = ls.to(torch.uint8)
    scales = torch.cat(
        [
            (b[:, :8] & 0xF) | ((b[:, 8:] & 0xF) << 4),
            ((b >> 4).view(n, 4, 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8,
                                                     device=b.device).view(1, 4, 1))
            .sum(1, dtype=torch.int32).to(torch.uint8),
        ],
        -1,
    )  # fmt: skip
    return torch.cat([hmask, qs, scales, fp16_bytes(d)], -1)


def quantize_q3_k(blocks: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """(n, 110) of float32 super-blocks (n, 256); quant_weights qw (n, 256) for the _impl."""
    n = blocks.shape[0]
    x = _lanes(blocks)
    if qw is None:
        scales, L = make_q3_quants(x, 4)
        scales = scales.view(n, _N_SUB)
        top = _largest(scales)
        iscale = div(-32.0, top, x)
        q = low_byte(nearest_int(iscale[:, None] * scales)).view(torch.int8).to(torch.int32)
        ls = torch.where(top[:, None] != 0, q.clamp(-32, 31) + 32, 0)  # C: scales left 0
        d = torch.where(top != 0, div(1.0, iscale, x), 0.0)
        return _q3_k_bytes(n, x, L, ls, d)
    sigma2 = mean_square(blocks, 2.0).repeat_interleave(_N_SUB)
    w = sigma2_weights(x, _lanes(qw), sigma2)
    sw = seqsum(w).view(n, _N_SUB).T.contiguous()  # (16, n)
    scales, L = make_qx_quants(x, 4, w)
    d_block, Ls = make_qx_quants(scales.view(n, _N_SUB).T.contiguous(), 32, sw)
    return _q3_k_bytes(n, x, L, Ls.T.contiguous(), d_block)


def _largest(scales: torch.Tensor) -> torch.Tensor:
    """The first scale of largest magnitude, signed (C's strict `>` scan from 0)."""
    top = torch.zeros_like(scales[:, 0])
    top_abs = torch.zeros_like(top)
    for s in scales.unbind(1):
        greater = s.abs() > top_abs
        top = torch.where(greater, s, top)
        top_abs = torch.where(greater, s.abs(), top_abs)
    return top
