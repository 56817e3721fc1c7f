"""numba body of the Q6_K quantizer: quantize_row_q6_K_ref (ggml-quants.c), its sub-blocks of 16
as lanes side by side as numerics/gguf/jit_k.py does for Q4_K and Q5_K."""

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


@numba.njit(cache=True, fastmath=False, inline="always", error_model="numpy")
def qx_lanes(xt, nmax, L, Laux, st, flags, scales):
    """make_qx_quants(16, nmax, x, L, rmse_type=1, NULL) on S sub-blocks of 16 at once (lanes as
    qkx2_lanes: xt (16, S), element i of sub-block j at [i, j]; L, Laux (16, S) the codes plus
    nmax; st (8, S), flags (2, S) scratch); scales[j] the scale of lane j."""
    S = xt.shape[1]
    amax, top, iscale, sumlx, suml2, scale, best = st[0], st[1], st[2], st[3], st[4], st[5], st[6]
    empty, take = flags[0], flags[1]
    for j in range(S):
        amax[j] = _F0
        top[j] = _F0
    for i in range(16):
        for j in range(S):
            ax = abs(xt[i, j])
            big = ax > amax[j]
            amax[j] = ax if big else amax[j]
            top[j] = xt[i, j] if big else top[j]
    for j in range(S):
        empty[j] = amax[j] < _EPS
        iscale[j] = np.float32(np.float32(-nmax) / top[j])
        sumlx[j] = _F0
        suml2[j] = _F0
    for i in range(16):
        for j in range(S):
            li = max(-nmax, min(nmax - 1, nearest_int(np.float32(iscale[j] * xt[i, j]))))
            L[i, j] = li + nmax
            wv = np.float32(xt[i, j] * xt[i, j])
            fl = np.float32(li)
            sumlx[j] = np.float32(sumlx[j] + np.float32(np.float32(wv * xt[i, j]) * fl))
            suml2[j] = np.float32(suml2[j] + np.float32(np.float32(wv * fl) * fl))
    for j in range(S):
        scale[j] = np.float32(sumlx[j] / suml2[j]) if suml2[j] != _F0 else _F0
        best[j] = np.float32(scale[j] * sumlx[j])
    tenth = np.float32(0.1)
    for step in range(-9, 10):
        if step == 0:
            continue
        numer = -np.float32(np.float32(nmax) + np.float32(tenth * np.float32(step)))
        for j in range(S):
            iscale[j] = np.float32(numer / top[j])
            sumlx[j] = _F0
            suml2[j] = _F0
        for i in range(16):
            for j in range(S):
                li = max(-nmax, min(nmax - 1, nearest_int(np.float32(iscale[j] * xt[i, j]))))
                Laux[i, j] = li + nmax
                wv = np.float32(xt[i, j] * xt[i, j])
                fl = np.float32(li)
                sumlx[j] = np.float32(sumlx[j] + np.float32(np.float32(wv * xt[i, j]) * fl))
                suml2[j] = np.float32(suml2[j] + np.float32(np.float32(wv * fl) * fl))
        for j in range(S):
            ok = suml2[j] > _F0 and np.float32(sumlx[j] * sumlx[j]) > np.float32(best[j] * suml2[j])
            take[j] = ok
            s = np.float32(sumlx[j] / suml2[j])
            scale[j] = s if ok else scale[j]
            best[j] = np.float32(s * sumlx[j]) if ok else best[j]
        for i in range(16):
            for j in range(S):
                L[i, j] = Laux[i, j] if take[j] else L[i, j]
    for j in range(S):
        scales[j] = _F0 if empty[j] else scale[j]
    for i in range(16):
        for j in range(S):
            L[i, j] = 0 if empty[j] else L[i, j]


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _q6_k_chunk(blocks, out):
    """quantize_row_q6_K_ref on the super-blocks `blocks` (nb, 256): their 16 nb sub-blocks as
    lanes (element i of sub-block j of block b at [i, 16 b + j]), scratch as _q45_k_chunk's."""
    nb = blocks.shape[0]
    S = 16 * nb
    xt = np.empty((16, S), np.float32)
    L = np.empty((16, S), np.int32)
    Laux = np.empty((16, S), np.int32)
    st = np.empty((8, S), np.float32)
    flags = np.empty((2, S), np.bool_)
    scales = np.empty(S, np.float32)
    for b in range(nb):
        for j in range(16):
            for i in range(16):
                xt[i, 16 * b + j] = blocks[b, 16 * j + i]
    qx_lanes(xt, 32, L, Laux, st, flags, scales)
    for b in range(nb):
        _q6_k_block(out[b], xt, L, scales, 16 * b)


@numba.njit(cache=True, fastmath=False, inline="always", error_model="numpy")
def _q6_k_block(o, xt, L, scales, s0):
    """One Q6_K super-block (sub-blocks: lanes s0 .. s0 + 15): ql[128], qh[64], scales[16], d."""
    max_scale = _F0
    max_abs = _F0
    for ib in range(16):
        s = scales[s0 + ib]
        if abs(s) > max_abs:
            max_abs = abs(s)
            max_scale = s
    if max_abs < _EPS:
        for k in range(210):
            o[k] = 0
        return
    iscale = np.float32(np.float32(-128.0) / max_scale)
    put_fp16(o, 208, np.float32(np.float32(1.0) / iscale))
    d_all = get_fp16(o, 208)
    for ib in range(16):
        o[192 + ib] = min(127, nearest_int(np.float32(iscale * scales[s0 + ib]))) & 0xFF
    for j in range(16):
        sc = o[192 + j]
        d = np.float32(d_all * np.float32(sc - 256 if sc >= 128 else sc))
        if d == _F0:
            continue
        for i in range(16):
            L[i, s0 + j] = max(-32, min(31, nearest_int(np.float32(xt[i, s0 + j] / d)))) + 32
    for h in range(2):
        for k in range(32):
            e = 128 * h + k  # elements e, e + 32, e + 64, e + 96: L[e % 16, s0 + e // 16]
            q1 = L[e % 16, s0 + e // 16]
            q2 = L[(e + 32) % 16, s0 + (e + 32) // 16]
            q3 = L[(e + 64) % 16, s0 + (e + 64) // 16]
            q4 = L[(e + 96) % 16, s0 + (e + 96) // 16]
            o[64 * h + k] = ((q1 & 0xF) | ((q3 & 0xF) << 4)) & 0xFF
            o[64 * h + 32 + k] = ((q2 & 0xF) | ((q4 & 0xF) << 4)) & 0xFF
            qh = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
            o[128 + 32 * h + k] = qh & 0xFF


@numba.njit(cache=True, fastmath=False, parallel=True, error_model="numpy")
def quantize_q6_k(blocks, out):
    n = blocks.shape[0]
    for c in prange((n + CHUNK - 1) // CHUNK):
        stop = min(n, c * CHUNK + CHUNK)
        _q6_k_chunk(blocks[c * CHUNK : stop], out[c * CHUNK : stop])
