"""numba bodies of the Q4_K and Q5_K quantizers: quantize_row_q{4,5}_K_ref (ggml-quants.c).

Conventions as numerics/gguf/jit.py (fastmath off, float32 constants, x86 conversions). The C
fits each sub-block of 32 on its own (make_qkx2_quants); here the sub-blocks of a run of
super-blocks are lanes side by side, element-major (`xt[i, lane]`), each lane doing the C's
statements in the C's order, so the floats are the C's and LLVM vectorises across lanes.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from qtool.numerics.gguf.jit import (
    _F0,
    CHUNK,
    get_fp16,
    nearest_int,
    put_fp16,
)


@numba.njit(cache=True, fastmath=False, inline="always", error_model="numpy")
def qkx2_lanes(xt, w, nmax, rmin, nstep, L, Laux, st, flags, scales, mins):
    """make_qkx2_quants(32, nmax, x, w, L, &the_min, Laux, rmin, 0.1f, nstep, false) on S
    sub-blocks at once, each a lane: xt, w (32, S) hold element i of sub-block j at [i, j];
    L, Laux (32, S) the codes; st (16, S) and flags (2, S) scratch. Every lane runs the C's
    statements in the C's order, so its floats are the C's; the lanes are independent, so LLVM
    runs them in vectors. A lane C would leave early (flat) or skip (D <= 0) computes anyway
    (into Inf/NaN: the numpy error model) and is then not taken."""
    S = xt.shape[1]
    lo, hi, sum_w, sum_x, scale, best, iscale = st[0], st[1], st[2], st[3], st[4], st[5], st[6]
    sum_l, sum_l2, sum_xl, cur, tscale, tmin, lo0 = (
        st[7],
        st[8],
        st[9],
        st[10],
        st[11],
        st[12],
        st[13],
    )
    flat, take = flags[0], flags[1]
    for j in range(S):
        lo[j] = xt[0, j]
        hi[j] = xt[0, j]
        sum_w[j] = w[0, j]
        sum_x[j] = np.float32(w[0, j] * xt[0, j])
    for i in range(1, 32):
        for j in range(S):
            v = xt[i, j]
            lo[j] = v if v < lo[j] else lo[j]
            hi[j] = v if v > hi[j] else hi[j]
            sum_w[j] = np.float32(sum_w[j] + w[i, j])
            sum_x[j] = np.float32(sum_x[j] + np.float32(w[i, j] * v))
    fmax = np.float32(nmax)
    for j in range(S):
        lo[j] = _F0 if lo[j] > _F0 else lo[j]
        lo0[j] = lo[j]
        flat[j] = hi[j] == lo[j]
        iscale[j] = np.float32(fmax / np.float32(hi[j] - lo[j]))
        scale[j] = np.float32(np.float32(1.0) / iscale[j])
        best[j] = _F0
    for i in range(32):
        for j in range(S):
            li = max(
                0, min(nmax, nearest_int(np.float32(iscale[j] * np.float32(xt[i, j] - lo[j]))))
            )
            L[i, j] = li
            diff = np.float32(np.float32(np.float32(scale[j] * np.float32(li)) + lo[j]) - xt[i, j])
            best[j] = np.float32(best[j] + np.float32(w[i, j] * np.float32(diff * diff)))
    rdelta = np.float32(0.1)
    for step in range(nstep + 1):
        numer = np.float32(np.float32(rmin + np.float32(rdelta * np.float32(step))) + fmax)
        for j in range(S):
            iscale[j] = np.float32(numer / np.float32(hi[j] - lo[j]))
            sum_l[j] = _F0
            sum_l2[j] = _F0
            sum_xl[j] = _F0
        for i in range(32):
            for j in range(S):
                li = max(
                    0, min(nmax, nearest_int(np.float32(iscale[j] * np.float32(xt[i, j] - lo[j]))))
                )
                Laux[i, j] = li
                fl = np.float32(li)
                wl = np.float32(w[i, j] * fl)
                sum_l[j] = np.float32(sum_l[j] + wl)
                sum_l2[j] = np.float32(sum_l2[j] + np.float32(wl * fl))
                sum_xl[j] = np.float32(sum_xl[j] + np.float32(wl * xt[i, j]))
        for j in range(S):
            D = np.float32(np.float32(sum_w[j] * sum_l2[j]) - np.float32(sum_l[j] * sum_l[j]))
            ts = np.float32(
                np.float32(np.float32(sum_w[j] * sum_xl[j]) - np.float32(sum_x[j] * sum_l[j])) / D
            )
            tm = np.float32(
                np.float32(np.float32(sum_l2[j] * sum_x[j]) - np.float32(sum_l[j] * sum_xl[j])) / D
            )
            if tm > _F0:
                tm = _F0
                ts = np.float32(sum_xl[j] / sum_l2[j])
            tscale[j] = ts
            tmin[j] = tm
            take[j] = D > _F0
            cur[j] = _F0
        for i in range(32):
            for j in range(S):
                diff = np.float32(
                    np.float32(np.float32(tscale[j] * np.float32(Laux[i, j])) + tmin[j]) - xt[i, j]
                )
                cur[j] = np.float32(cur[j] + np.float32(w[i, j] * np.float32(diff * diff)))
        for j in range(S):
            ok = take[j] and cur[j] < best[j]
            take[j] = ok
            best[j] = cur[j] if ok else best[j]
            scale[j] = tscale[j] if ok else scale[j]
            lo[j] = tmin[j] if ok else lo[j]
        for i in range(32):
            for j in range(S):
                L[i, j] = Laux[i, j] if take[j] else L[i, j]
    for j in range(S):
        scales[j] = _F0 if flat[j] else scale[j]
        mins[j] = -(lo0[j] if flat[j] else lo[j])
    for i in range(32):
        for j in range(S):
            L[i, j] = 0 if flat[j] else L[i, j]


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _q45_k_chunk(blocks, out, nmax):
    """quantize_row_q4_K_ref (nmax 15) / q5_K (nmax 31) on the super-blocks `blocks` (nb, 256):
    their 8 nb sub-blocks as lanes (element i of sub-block j of block b at [i, 8 b + j]).
    The scratch arrays are C-contiguous (nb, 256)-sized, which the vectoriser needs."""
    nb = blocks.shape[0]
    S = 8 * nb
    xt = np.empty((32, S), np.float32)
    w = np.empty((32, S), np.float32)
    L = np.empty((32, S), np.int32)
    Laux = np.empty((32, S), np.int32)
    st = np.empty((16, S), np.float32)
    flags = np.empty((2, S), np.bool_)
    scales = np.empty(S, np.float32)
    mins = np.empty(S, np.float32)
    rmin = np.float32(-1.0) if nmax == 15 else np.float32(-0.5)
    nstep = 20 if nmax == 15 else 15
    for b in range(nb):
        for j in range(8):
            for i in range(32):
                xt[i, 8 * b + j] = blocks[b, 32 * j + i]
    sum_x2, av_x = st[14], st[15]
    for j in range(S):
        sum_x2[j] = _F0
    for i in range(32):
        for j in range(S):
            sum_x2[j] = np.float32(sum_x2[j] + np.float32(xt[i, j] * xt[i, j]))
    for j in range(S):
        av_x[j] = np.float32(np.sqrt(np.float32(sum_x2[j] / np.float32(32.0))))
    for i in range(32):
        for j in range(S):
            w[i, j] = np.float32(av_x[j] + abs(xt[i, j]))
    qkx2_lanes(xt, w, nmax, rmin, nstep, L, Laux, st, flags, scales, mins)
    for b in range(nb):
        _q45_k_header(out[b], nmax, xt, L, scales, mins, 8 * b)
        _q45_k_pack(out[b], nmax, L, 8 * b)


@numba.njit(cache=True, fastmath=False, inline="always", error_model="numpy")
def _q45_k_header(o, nmax, xt, L, scales, mins, s0):
    """The header (d, dmin, scales[12]) of one super-block whose sub-blocks are lanes s0 ..
    s0 + 7, and its codes refitted to the scales as stored."""
    max_scale = _F0
    max_min = _F0
    for j in range(8):
        if scales[s0 + j] > max_scale:
            max_scale = scales[s0 + j]
        if mins[s0 + j] > max_min:
            max_min = mins[s0 + j]
    sixty3 = np.float32(63.0)
    inv_scale = np.float32(sixty3 / max_scale) if max_scale > _F0 else _F0
    inv_min = np.float32(sixty3 / max_min) if max_min > _F0 else _F0
    for k in range(12):
        o[4 + k] = 0
    for j in range(8):
        ls = min(63, nearest_int(np.float32(inv_scale * scales[s0 + j])) & 0xFF)
        lm = min(63, nearest_int(np.float32(inv_min * mins[s0 + j])) & 0xFF)
        if j < 4:
            o[4 + j] = ls
            o[4 + j + 4] = lm
        else:
            o[4 + j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            o[4 + j - 4] |= (ls >> 4) << 6
            o[4 + j] |= (lm >> 4) << 6
    put_fp16(o, 0, np.float32(max_scale / sixty3))
    put_fp16(o, 2, np.float32(max_min / sixty3))
    d_all = get_fp16(o, 0)
    dmin_all = get_fp16(o, 2)
    for j in range(8):
        if j < 4:
            sc = o[4 + j] & 63
            m = o[4 + j + 4] & 63
        else:
            sc = (o[4 + j + 4] & 0xF) | ((o[4 + j - 4] >> 6) << 4)
            m = (o[4 + j + 4] >> 4) | ((o[4 + j] >> 6) << 4)
        d = np.float32(d_all * np.float32(sc))
        if d == _F0:
            continue
        dm = np.float32(dmin_all * np.float32(m))
        for i in range(32):
            refit = nearest_int(np.float32(np.float32(xt[i, s0 + j] + dm) / d))
            L[i, s0 + j] = max(0, min(nmax, refit))


@numba.njit(cache=True, fastmath=False, inline="always", error_model="numpy")
def _q45_k_pack(o, nmax, L, s0):
    """Q4_K: qs[128] at 16; Q5_K: qh[32] at 16, qs[128] at 48 (element 64 c + k and 64 c + 32
    + k share byte 32 c + k)."""
    qs_at = 16 if nmax == 15 else 48
    if nmax == 31:
        for k in range(32):
            o[16 + k] = 0
    for ch in range(4):
        for k in range(32):
            l1 = L[k, s0 + 2 * ch]
            l2 = L[k, s0 + 2 * ch + 1]
            if nmax == 31:
                if l1 > 15:
                    l1 -= 16
                    o[16 + k] |= 1 << (2 * ch)
                if l2 > 15:
                    l2 -= 16
                    o[16 + k] |= 2 << (2 * ch)
            o[qs_at + 32 * ch + k] = (l1 | (l2 << 4)) & 0xFF


@numba.njit(cache=True, fastmath=False, parallel=True, error_model="numpy")
def quantize_q45_k(blocks, out, nmax):
    """Q4_K (nmax 15): d, dmin, scales[12], qs[128]; Q5_K (nmax 31): ..., qh[32], qs[128]."""
    n = blocks.shape[0]
    for c in prange((n + CHUNK - 1) // CHUNK):
        stop = min(n, c * CHUNK + CHUNK)
        _q45_k_chunk(blocks[c * CHUNK : stop], out[c * CHUNK : stop], nmax)
