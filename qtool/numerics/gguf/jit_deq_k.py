"""numba bodies of dequantize_row_q{2..6}_K: (n, type_size) uint8 -> (n, 256) float32 with the
float operations of gguf.quants and numerics/gguf/dequant_k.py, in the same order."""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from qtool.numerics.gguf.jit import (
    get_fp16,
)


@numba.njit(cache=True, fastmath=False, parallel=True)
def dequantize_k(raw, out, kind):
    """kind 2..6: Q2_K ... Q6_K, as numerics/gguf/dequant_k.py computes them."""
    for i in prange(raw.shape[0]):
        b, y = raw[i], out[i]
        if kind == 2:
            _deq_q2_k(b, y)
        elif kind == 3:
            _deq_q3_k(b, y)
        elif kind == 6:
            _deq_q6_k(b, y)
        else:
            _deq_q45_k(b, y, kind)


@numba.njit(cache=True, fastmath=False, inline="always")
def _deq_q2_k(b, y):
    d = get_fp16(b, 80)
    dmin = get_fp16(b, 82)
    for s in range(16):
        dl = np.float32(d * np.float32(np.int64(b[s]) & 0x0F))
        ml = np.float32(dmin * np.float32(np.int64(b[s]) >> 4))
        half, quarter = s // 8, (s % 8) // 2
        for k in range(16):
            byte = np.int64(b[16 + 32 * half + 16 * (s % 2) + k])
            q = (byte >> (2 * quarter)) & 3
            y[16 * s + k] = np.float32(np.float32(dl * np.float32(q)) - ml)


@numba.njit(cache=True, fastmath=False, inline="always")
def _deq_q3_k(b, y):
    d = get_fp16(b, 108)
    for s in range(16):
        low = np.int64(b[96 + s % 8]) >> (4 * (s // 8)) & 0x0F
        high = (np.int64(b[104 + s % 4]) >> (2 * (s // 4))) & 3
        dl = np.float32(d * np.float32((low | (high << 4)) - 32))
        half, quarter = s // 8, (s % 8) // 2
        for k in range(16):
            e = 16 * (s % 2) + k
            ql = (np.int64(b[32 + 32 * half + e]) >> (2 * quarter)) & 3
            hbit = (np.int64(b[e]) >> (4 * half + quarter)) & 1
            q = ql - (0 if hbit else 4)
            y[16 * s + k] = np.float32(dl * np.float32(q))


@numba.njit(cache=True, fastmath=False, inline="always")
def _deq_q45_k(b, y, kind):
    d = get_fp16(b, 0)
    dmin = get_fp16(b, 2)
    qs_at = 16 if kind == 4 else 48
    for j in range(8):
        if j < 4:
            sc = np.int64(b[4 + j]) & 63
            m = np.int64(b[8 + j]) & 63
        else:
            sc = (np.int64(b[8 + j]) & 0xF) | ((np.int64(b[j]) >> 6) << 4)
            m = (np.int64(b[8 + j]) >> 4) | ((np.int64(b[4 + j]) >> 6) << 4)
        dl = np.float32(d * np.float32(sc))
        ml = np.float32(dmin * np.float32(m))
        shift = 4 * (j % 2)
        for k in range(32):
            q = (np.int64(b[qs_at + 32 * (j // 2) + k]) >> shift) & 0x0F
            if kind == 5:
                q |= ((np.int64(b[16 + k]) >> j) & 1) << 4
            y[32 * j + k] = np.float32(np.float32(dl * np.float32(q)) - ml)


@numba.njit(cache=True, fastmath=False, inline="always")
def _deq_q6_k(b, y):
    d = get_fp16(b, 208)
    for s in range(16):
        sc = np.int64(b[192 + s])
        dl = np.float32(d * np.float32(sc - 256 if sc >= 128 else sc))
        for k in range(16):
            e = 16 * s + k
            h, r = e // 128, e % 128
            quarter, lane = r // 32, r % 32
            low = (np.int64(b[64 * h + 32 * (quarter % 2) + lane]) >> (4 * (quarter // 2))) & 0x0F
            high = (np.int64(b[128 + 32 * h + lane]) >> (2 * quarter)) & 3
            y[e] = np.float32(dl * np.float32((low | (high << 4)) - 32))
