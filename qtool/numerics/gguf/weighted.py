"""ggml's quantizers given quant_weights (an importance vector per column, llama-quantize
--imatrix): quantize_row_{q4_0,q4_1,q5_0,q5_1,q4_K,q5_K}_impl, in torch (Q2_K, Q3_K and Q6_K
take theirs in q23k.py and q6k.py). Byte-identical to ggml-quants.c's x86-64 release build.

These are other algorithms than the reference quantizers, not the same ones reweighted: the
legacy types fit each block of 32 by least squares (make_qx_quants / make_qkx3_quants)
weighted by qw * sqrt(sigma2 + x^2), sigma2 the mean square of the whole row; the K-types fit
each sub-block with make_qkx3_quants and then the sub-block scales and mins themselves
(make_qp_quants) weighted by their sub-blocks' summed weights.
"""

from __future__ import annotations

import torch

from qtool.gguf_types import QK_K
from qtool.numerics.gguf.cops import (
    div,
    fp16_bytes,
    fp16_value,
    low_byte,
    nearest_int,
    pack_nibbles,
    seqsum,
)
from qtool.numerics.gguf.dequant_k import scale_min_k4
from qtool.numerics.gguf.q6k import make_qx_quants
from qtool.numerics.gguf.q45k import _pack_scales, make_qkx2_quants
from qtool.numerics.gguf.qfit import make_qp_quants, mean_square, sigma2_weights

_SUB = 32
_N_SUB = QK_K // _SUB


def _lanes(t: torch.Tensor, width: int) -> torch.Tensor:
    """(n, k * width) -> (width, n k): element i of group j of block b at [i, k b + j]."""
    return t.reshape(-1, width).T.contiguous()


def _q45_k(blocks: torch.Tensor, qw: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (n, 16) header and (n, 256) codes of quantize_row_q{4,5}_K_impl."""
    n = blocks.shape[0]
    x = _lanes(blocks, _SUB)  # (32, S)
    sigma2 = mean_square(blocks, 2.0).repeat_interleave(_N_SUB)
    w = sigma2_weights(x, _lanes(qw, _SUB), sigma2)
    sw = seqsum(w).view(n, _N_SUB).T.contiguous()  # (8, n)
    scales, mins, L = make_qkx2_quants(x, w, nmax, -0.9, 0.05, 36)  # make_qkx3_quants
    d_block, Ls = make_qp_quants(scales.view(n, _N_SUB).T.contiguous(), sw, 63)
    m_block, Lm = make_qp_quants(mins.view(n, _N_SUB).T.contiguous(), sw, 63)
    ls, lm = low_byte(Ls.T), low_byte(Lm.T)  # (n, 8) uint8
    if nmax == 31:  # Q5_K clamps to 6 bits, Q4_K packs the byte as it is
        ls, lm = ls.clamp(max=63), lm.clamp(max=63)
    packed = _pack_scales(ls, lm)
    sc, m = scale_min_k4(packed)  # what the file says, as the C reads it back
    step = (fp16_value(d_block)[:, None] * sc.to(torch.float32)).reshape(-1)
    offset = (fp16_value(m_block)[:, None] * m.to(torch.float32)).reshape(-1)
    refit = nearest_int(div(x + offset, step, x)).clamp_(0, nmax)
    L = torch.where(step != 0, refit, L)  # C: `if (!d) continue;`
    header = torch.cat([fp16_bytes(d_block), fp16_bytes(m_block), packed], -1)
    return header, L.T.reshape(n, QK_K)


def quantize_q4_k(blocks: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    header, L = _q45_k(blocks, qw, 15)
    q = L.view(-1, 4, 2, _SUB)
    return torch.cat([header, pack_nibbles(q[:, :, 0], q[:, :, 1]).flatten(1)], -1)


def quantize_q5_k(blocks: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    header, L = _q45_k(blocks, qw, 31)
    q = L.view(-1, 4, 2, _SUB)
    shifts = torch.arange(_N_SUB, dtype=torch.int32, device=L.device).view(1, 4, 2, 1)
    qh = ((q >> 4) << shifts).sum((1, 2)).to(torch.uint8)
    return torch.cat([header, qh, pack_nibbles(q[:, :, 0], q[:, :, 1]).flatten(1)], -1)


def _legacy_weights(blocks: torch.Tensor, qw: torch.Tensor, sigma2: torch.Tensor) -> tuple[
    torch.Tensor, torch.Tensor
]:  # fmt: skip
    """(32, n) x and weights of blocks (n, 32) whose rows' mean squares are sigma2 (n,)."""
    x = _lanes(blocks, 32)
    return x, sigma2_weights(x, _lanes(qw, 32), sigma2)


def _qh(L: torch.Tensor) -> torch.Tensor:
    """(n, 4) little-endian uint32 whose bit j is bit 4 of code j, codes L (32, n)."""
    bits = ((L >> 4) & 1).T.reshape(-1, 4, 8)
    weights = 1 << torch.arange(8, dtype=torch.int32, device=L.device)
    return (bits * weights).sum(-1).to(torch.uint8)


def _nibbles(L: torch.Tensor) -> torch.Tensor:
    """(n, 16): byte j = code j | code j + 16 << 4, codes L (32, n)."""
    return pack_nibbles(L[:16].T, L[16:].T)


def quantize_q4_0(blocks: torch.Tensor, qw: torch.Tensor, sigma2: torch.Tensor) -> torch.Tensor:
    x, w = _legacy_weights(blocks, qw, sigma2)
    d, L = make_qx_quants(x, 8, w)
    return torch.cat([fp16_bytes(d), _nibbles(L)], -1)


def quantize_q5_0(blocks: torch.Tensor, qw: torch.Tensor, sigma2: torch.Tensor) -> torch.Tensor:
    x, w = _legacy_weights(blocks, qw, sigma2)
    d, L = make_qx_quants(x, 16, w)
    return torch.cat([fp16_bytes(d), _qh(L), _nibbles(L)], -1)


def quantize_q4_1(blocks: torch.Tensor, qw: torch.Tensor, sigma2: torch.Tensor) -> torch.Tensor:
    x, w = _legacy_weights(blocks, qw, sigma2)
    d, the_min, L = make_qkx2_quants(x, w, 15, -0.9, 0.05, 36)  # make_qkx3_quants
    return torch.cat([fp16_bytes(d), fp16_bytes(-the_min), _nibbles(L)], -1)


def quantize_q5_1(blocks: torch.Tensor, qw: torch.Tensor, sigma2: torch.Tensor) -> torch.Tensor:
    x, w = _legacy_weights(blocks, qw, sigma2)
    d, the_min, L = make_qkx2_quants(x, w, 31, -0.9, 0.05, 36)
    return torch.cat([fp16_bytes(d), fp16_bytes(-the_min), _qh(L), _nibbles(L)], -1)
