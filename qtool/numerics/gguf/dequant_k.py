"""Dequantize Q2_K ... Q6_K super-blocks: (n, type_size) uint8 -> (n, 256) float32.

The same float operations, in the same order, as gguf-py's `gguf.quants` and ggml's
dequantize_row_*_K: `(d * scale) * q - (dmin * min)`, each product rounded to float32.
"""

from __future__ import annotations

import torch

from qtool.numerics.gguf.cops import read_fp16


def _shifted(b: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """(n, rows, len(shifts), cols) fields (b >> shift) & mask of the bytes b (n, rows, cols)."""
    s = torch.tensor(shifts, dtype=torch.uint8, device=b.device).view(1, 1, -1, 1)
    return (b.unsqueeze(2) >> s) & mask


def scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 8) 6-bit scales and mins of the 12 packed bytes of Q4_K/Q5_K (get_scale_min_k4)."""
    d, m, m_d = scales.view(-1, 3, 4).unbind(1)
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], -1)
    return sc, mn


def _scaled(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(n, k, 1): fp16 super-scale (n, 2 bytes) times per-sub-block integers q (n, k)."""
    return (read_fp16(d)[:, None] * q.to(torch.float32)).unsqueeze(-1)


def dequantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs, d, dmin = torch.split(blocks, [16, 64, 2, 2], 1)
    dl, ml = _scaled(d, scales & 0x0F), _scaled(dmin, scales >> 4)  # (n, 16, 1)
    q = _shifted(qs.reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16)
    return (dl * q.to(torch.float32) - ml).reshape(n, 256)


def dequantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, scales, d = torch.split(blocks, [32, 64, 12, 2], 1)
    low = _shifted(scales[:, :8].reshape(n, 1, 8), [0, 4], 0x0F).reshape(n, 16)
    high = _shifted(scales[:, 8:].reshape(n, 1, 4), [0, 2, 4, 6], 0x03).reshape(n, 16)
    sc = (low | (high << 4)).to(torch.int32) - 32
    dl = _scaled(d, sc)  # (n, 16, 1)
    ql = _shifted(qs.reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16)
    qh = _shifted(hmask.reshape(n, 1, 32), list(range(8)), 1).reshape(n, 16, 16) ^ 1
    q = ql.to(torch.int32) - (qh.to(torch.int32) << 2)  # a set hmask bit means no offset
    return (dl * q.to(torch.float32)).reshape(n, 256)


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin, scales, qs = torch.split(blocks, [2, 2, 12, 128], 1)
    sc, mn = scale_min_k4(scales)
    q = _shifted(qs.reshape(n, 4, 32), [0, 4], 0x0F).reshape(n, 8, 32)
    return (_scaled(d, sc) * q.to(torch.float32) - _scaled(dmin, mn)).reshape(n, 256)


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin, scales, qh, qs = torch.split(blocks, [2, 2, 12, 32, 128], 1)
    sc, mn = scale_min_k4(scales)
    ql = _shifted(qs.reshape(n, 4, 32), [0, 4], 0x0F).reshape(n, 8, 32)
    high = _shifted(qh.reshape(n, 1, 32), list(range(8)), 1).reshape(n, 8, 32)
    q = (ql | (high << 4)).to(torch.float32)
    return (_scaled(d, sc) * q - _scaled(dmin, mn)).reshape(n, 256)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh, scales, d = torch.split(blocks, [128, 64, 16, 2], 1)
    dl = _scaled(d, scales.contiguous().view(torch.int8))  # (n, 16, 1)
    low = _shifted(ql.reshape(n, 2, 64), [0, 4], 0x0F).reshape(n, 8, 32)
    high = _shifted(qh.reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.int32) - 32
    return (dl * q.reshape(n, 16, 16).to(torch.float32)).reshape(n, 256)
