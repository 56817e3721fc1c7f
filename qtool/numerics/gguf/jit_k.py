"""numba bodies of the K-quant kernels: quantize_row_q{4,5,6}_K_ref and dequantize_row_q{2..6}_K.

Conventions as numerics/gguf/jit.py (fastmath off, float32 constants, x86 conversions): each
function is the C's, statement by statement, on one super-block of 256.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from qtool.numerics.gguf.jit import (
    _EPS,
    _F0,
    CHUNK,
    get_fp16,
    nearest_int,
    put_fp16,
)

_QK = 256


@numba.njit(cache=True, fastmath=False, inline="always")
def make_qkx2_quants(x, w, nmax, rmin, nstep, L, Laux):
    """make_qkx2_quants(32, nmax, x, w, L, &the_min, Laux, rmin, 0.1f, nstep, false):
    returns (scale, the_min); L holds the codes."""
    n = x.shape[0]
    lo = x[0]
    hi = x[0]
    sum_w = w[0]
    sum_x = np.float32(sum_w * x[0])
    for i in range(1, n):
        if x[i] < lo:
            lo = x[i]
        if x[i] > hi:
            hi = x[i]
        sum_w = np.float32(sum_w + w[i])
        sum_x = np.float32(sum_x + np.float32(w[i] * x[i]))
    if lo > _F0:
        lo = _F0
    if hi == lo:
        for i in range(n):
            L[i] = 0
        return _F0, -lo
    fmax = np.float32(nmax)
    iscale = np.float32(fmax / np.float32(hi - lo))
    scale = np.float32(np.float32(1.0) / iscale)
    best = _F0
    for i in range(n):
        li = max(0, min(nmax, nearest_int(np.float32(iscale * np.float32(x[i] - lo)))))
        L[i] = li
        diff = np.float32(np.float32(np.float32(scale * np.float32(li)) + lo) - x[i])
        best = np.float32(best + np.float32(w[i] * np.float32(diff * diff)))
    rdelta = np.float32(0.1)
    for step in range(nstep + 1):
        numer = np.float32(np.float32(rmin + np.float32(rdelta * np.float32(step))) + fmax)
        iscale = np.float32(numer / np.float32(hi - lo))
        sum_l = _F0
        sum_l2 = _F0
        sum_xl = _F0
        for i in range(n):
            li = max(0, min(nmax, nearest_int(np.float32(iscale * np.float32(x[i] - lo)))))
            Laux[i] = li
            fl = np.float32(li)
            wl = np.float32(w[i] * fl)
            sum_l = np.float32(sum_l + wl)
            sum_l2 = np.float32(sum_l2 + np.float32(wl * fl))
            sum_xl = np.float32(sum_xl + np.float32(wl * x[i]))
        D = np.float32(np.float32(sum_w * sum_l2) - np.float32(sum_l * sum_l))
        if D > _F0:
            this_scale = np.float32(
                np.float32(np.float32(sum_w * sum_xl) - np.float32(sum_x * sum_l)) / D
            )
            this_min = np.float32(
                np.float32(np.float32(sum_l2 * sum_x) - np.float32(sum_l * sum_xl)) / D
            )
            if this_min > _F0:
                this_min = _F0
                this_scale = np.float32(sum_xl / sum_l2)
            cur = _F0
            for i in range(n):
                diff = np.float32(
                    np.float32(np.float32(this_scale * np.float32(Laux[i])) + this_min) - x[i]
                )
                cur = np.float32(cur + np.float32(w[i] * np.float32(diff * diff)))
            if cur < best:
                for i in range(n):
                    L[i] = Laux[i]
                best = cur
                scale = this_scale
                lo = this_min
    return scale, -lo


@numba.njit(cache=True, fastmath=False, inline="always")
def _q45_k(x, nmax, rmin, nstep, out, L, Laux, w, scales, mins):
    """quantize_row_q4_K_ref (nmax 15) / q5_K (nmax 31) on one super-block: fills the header
    (d, dmin, scales[12]) of `out` and the codes L[256]."""
    max_scale = _F0
    max_min = _F0
    for j in range(8):
        xs = x[32 * j : 32 * j + 32]
        sum_x2 = _F0
        for i in range(32):
            sum_x2 = np.float32(sum_x2 + np.float32(xs[i] * xs[i]))
        av_x = np.float32(np.sqrt(np.float32(sum_x2 / np.float32(32.0))))
        for i in range(32):
            w[i] = np.float32(av_x + abs(xs[i]))
        s, m = make_qkx2_quants(xs, w, nmax, rmin, nstep, L[32 * j : 32 * j + 32], Laux)
        scales[j] = s
        mins[j] = m
        if s > max_scale:
            max_scale = s
        if m > max_min:
            max_min = m
    sixty3 = np.float32(63.0)
    inv_scale = np.float32(sixty3 / max_scale) if max_scale > _F0 else _F0
    inv_min = np.float32(sixty3 / max_min) if max_min > _F0 else _F0
    for k in range(12):
        out[4 + k] = 0
    for j in range(8):
        ls = min(63, nearest_int(np.float32(inv_scale * scales[j])) & 0xFF)
        lm = min(63, nearest_int(np.float32(inv_min * mins[j])) & 0xFF)
        if j < 4:
            out[4 + j] = ls
            out[4 + j + 4] = lm
        else:
            out[4 + j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            out[4 + j - 4] |= (ls >> 4) << 6
            out[4 + j] |= (lm >> 4) << 6
    put_fp16(out, 0, np.float32(max_scale / sixty3))
    put_fp16(out, 2, np.float32(max_min / sixty3))
    d_all = get_fp16(out, 0)
    dmin_all = get_fp16(out, 2)
    for j in range(8):
        if j < 4:
            sc = out[4 + j] & 63
            m = out[4 + j + 4] & 63
        else:
            sc = (out[4 + j + 4] & 0xF) | ((out[4 + j - 4] >> 6) << 4)
            m = (out[4 + j + 4] >> 4) | ((out[4 + j] >> 6) << 4)
        d = np.float32(d_all * np.float32(sc))
        if d == _F0:
            continue
        dm = np.float32(dmin_all * np.float32(m))
        for i in range(32 * j, 32 * j + 32):
            L[i] = max(0, min(nmax, nearest_int(np.float32(np.float32(x[i] + dm) / d))))


@numba.njit(cache=True, fastmath=False, parallel=True)
def quantize_q45_k(blocks, out, nmax):
    """Q4_K (nmax 15): d, dmin, scales[12], qs[128]; Q5_K (nmax 31): ..., qh[32], qs[128]."""
    n = blocks.shape[0]
    rmin = np.float32(-1.0) if nmax == 15 else np.float32(-0.5)
    nstep = 20 if nmax == 15 else 15
    for c in prange((n + CHUNK - 1) // CHUNK):
        L = np.empty(_QK, np.int64)
        Laux = np.empty(32, np.int64)
        w = np.empty(32, np.float32)
        scales = np.empty(8, np.float32)
        mins = np.empty(8, np.float32)
        for i in range(c * CHUNK, min(n, c * CHUNK + CHUNK)):
            o = out[i]
            _q45_k(blocks[i], nmax, rmin, nstep, o, L, Laux, w, scales, mins)
            qs_at = 16 if nmax == 15 else 48
            if nmax == 31:
                for j in range(32):
                    o[16 + j] = 0
            for ch in range(4):
                for j in range(32):
                    l1 = L[64 * ch + j]
                    l2 = L[64 * ch + 32 + j]
                    if nmax == 31:
                        if l1 > 15:
                            l1 -= 16
                            o[16 + j] |= 1 << (2 * ch)
                        if l2 > 15:
                            l2 -= 16
                            o[16 + j] |= 2 << (2 * ch)
                    o[qs_at + 32 * ch + j] = (l1 | (l2 << 4)) & 0xFF


@numba.njit(cache=True, fastmath=False, inline="always")
def make_qx_quants(x, nmax, L):
    """make_qx_quants(16, nmax, x, L, rmse_type=1, NULL): the scale; L holds codes + nmax."""
    n = x.shape[0]
    top = _F0
    amax = _F0
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            top = x[i]
    if amax < _EPS:
        for i in range(n):
            L[i] = 0
        return _F0
    iscale = np.float32(np.float32(-nmax) / top)
    sumlx = _F0
    suml2 = _F0
    for i in range(n):
        li = max(-nmax, min(nmax - 1, nearest_int(np.float32(iscale * x[i]))))
        L[i] = li + nmax
        wv = np.float32(x[i] * x[i])
        fl = np.float32(li)
        sumlx = np.float32(sumlx + np.float32(np.float32(wv * x[i]) * fl))
        suml2 = np.float32(suml2 + np.float32(np.float32(wv * fl) * fl))
    scale = np.float32(sumlx / suml2) if suml2 != _F0 else _F0
    best = np.float32(scale * sumlx)
    tenth = np.float32(0.1)
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = np.float32(
            -np.float32(np.float32(nmax) + np.float32(tenth * np.float32(step))) / top
        )
        sumlx = _F0
        suml2 = _F0
        for i in range(n):
            li = max(-nmax, min(nmax - 1, nearest_int(np.float32(iscale * x[i]))))
            wv = np.float32(x[i] * x[i])
            fl = np.float32(li)
            sumlx = np.float32(sumlx + np.float32(np.float32(wv * x[i]) * fl))
            suml2 = np.float32(suml2 + np.float32(np.float32(wv * fl) * fl))
        if suml2 > _F0 and np.float32(sumlx * sumlx) > np.float32(best * suml2):
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(np.float32(iscale * x[i]))))
            scale = np.float32(sumlx / suml2)
            best = np.float32(scale * sumlx)
    return scale


@numba.njit(cache=True, fastmath=False, inline="always")
def _q6_k(x, out, L, scales):
    """quantize_row_q6_K_ref on one super-block: ql[128], qh[64], scales[16], d."""
    max_scale = _F0
    max_abs = _F0
    for ib in range(16):
        s = make_qx_quants(x[16 * ib : 16 * ib + 16], 32, L[16 * ib : 16 * ib + 16])
        scales[ib] = s
        if abs(s) > max_abs:
            max_abs = abs(s)
            max_scale = s
    if max_abs < _EPS:
        for k in range(210):
            out[k] = 0
        return
    iscale = np.float32(np.float32(-128.0) / max_scale)
    put_fp16(out, 208, np.float32(np.float32(1.0) / iscale))
    d_all = get_fp16(out, 208)
    for ib in range(16):
        out[192 + ib] = min(127, nearest_int(np.float32(iscale * scales[ib]))) & 0xFF
    for j in range(16):
        sc = out[192 + j]
        d = np.float32(d_all * np.float32(sc - 256 if sc >= 128 else sc))
        if d == _F0:
            continue
        for i in range(16 * j, 16 * j + 16):
            L[i] = max(-32, min(31, nearest_int(np.float32(x[i] / d)))) + 32
    for h in range(2):
        for j in range(32):
            b = 128 * h + j
            q1, q2, q3, q4 = L[b], L[b + 32], L[b + 64], L[b + 96]
            out[64 * h + j] = ((q1 & 0xF) | ((q3 & 0xF) << 4)) & 0xFF
            out[64 * h + 32 + j] = ((q2 & 0xF) | ((q4 & 0xF) << 4)) & 0xFF
            qh = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
            out[128 + 32 * h + j] = qh & 0xFF


@numba.njit(cache=True, fastmath=False, parallel=True)
def quantize_q6_k(blocks, out):
    n = blocks.shape[0]
    for c in prange((n + CHUNK - 1) // CHUNK):
        L = np.empty(_QK, np.int64)
        scales = np.empty(16, np.float32)
        for i in range(c * CHUNK, min(n, c * CHUNK + CHUNK)):
            _q6_k(blocks[i], out[i], L, scales)


# ---------------------------------------------------------------- K dequantize


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
