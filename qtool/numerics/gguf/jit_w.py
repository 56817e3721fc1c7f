# mypy: disallow-untyped-defs=False, disallow-untyped-calls=False, check-untyped-defs=False
"""numba bodies of ggml's quantizers given quant_weights (the *_impl functions of ggml-quants.c:
quantize_row_{q4_0,q4_1,q5_0,q5_1,q2_K,q3_K,q4_K,q5_K,q6_K}_impl), the C transcribed line by
line, one row at a time (a row's blocks in order, as the C), rows in parallel.

Conventions as numerics/gguf/jit.py: fastmath off, every float32 operation wrapped so it is one
IEEE operation in the C's order, float32 constants, x86's integer conversions. Same bytes as
the torch kernels (weighted.py, q23k.py, q6k.py) and as the C (tests/numerics/
test_gguf_imatrix.py). mypy leaves the bodies untyped, as pyproject's override does for the
other jit*.py: numba types them.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from qtool.numerics.gguf.jit import _EPS, _F0, _F1, get_fp16, nearest_int, put_fp16

_F32 = np.float32
_RMIN3 = np.float32(-0.9)  # make_qkx3_quants' rmin, rdelta and steps in every *_impl
_RDELTA3 = np.float32(0.05)
_NSTEP3 = 36
_TENTH = np.float32(0.1)
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
         "Q5_K": 13, "Q6_K": 14}  # fmt: skip


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def qkx3(x, w, nmax, L, Laux):
    """make_qkx3_quants(n, nmax, x, w, L, &the_min, Laux, -0.9f, 0.05f, 36, false): returns
    (scale, the_min)."""
    n = x.shape[0]
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = _F32(sum_w * x[0])
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w = _F32(sum_w + w[i])
        sum_x = _F32(sum_x + _F32(w[i] * x[i]))
    if mn > _F0:
        mn = _F0
    if mx <= mn:
        for i in range(n):
            L[i] = 0
        return _F0, -mn
    iscale = _F32(_F32(nmax) / _F32(mx - mn))
    scale = _F32(_F1 / iscale)
    best = _F0
    for i in range(n):
        li = max(0, min(nmax, nearest_int(_F32(iscale * _F32(x[i] - mn)))))
        L[i] = li
        diff = _F32(_F32(_F32(scale * _F32(li)) + mn) - x[i])
        best = _F32(best + _F32(w[i] * _F32(diff * diff)))
    for step in range(_NSTEP3 + 1):
        numer = _F32(_F32(_RMIN3 + _F32(_RDELTA3 * _F32(step))) + _F32(nmax))
        iscale = _F32(numer / _F32(mx - mn))
        sum_l = _F0
        sum_l2 = _F0
        sum_xl = _F0
        for i in range(n):
            li = max(0, min(nmax, nearest_int(_F32(iscale * _F32(x[i] - mn)))))
            Laux[i] = li
            fl = _F32(li)
            wl = _F32(w[i] * fl)
            sum_l = _F32(sum_l + wl)
            sum_l2 = _F32(sum_l2 + _F32(wl * fl))
            sum_xl = _F32(sum_xl + _F32(wl * x[i]))
        D = _F32(_F32(sum_w * sum_l2) - _F32(sum_l * sum_l))
        if D > _F0:
            this_scale = _F32(_F32(_F32(sum_w * sum_xl) - _F32(sum_x * sum_l)) / D)
            this_min = _F32(_F32(_F32(sum_l2 * sum_x) - _F32(sum_l * sum_xl)) / D)
            if this_min > _F0:
                this_min = _F0
                this_scale = _F32(sum_xl / sum_l2)
            mad = _F0
            for i in range(n):
                diff = _F32(_F32(_F32(this_scale * _F32(Laux[i])) + this_min) - x[i])
                mad = _F32(mad + _F32(w[i] * _F32(diff * diff)))
            if mad < best:
                for i in range(n):
                    L[i] = Laux[i]
                best = mad
                scale = this_scale
                mn = this_min
    return scale, -mn


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def qp(x, qw, nmax, L):
    """make_qp_quants(n, nmax, x, L, qw): L holds the C's uint8 codes."""
    n = x.shape[0]
    mx = _F0
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < _EPS:
        for i in range(n):
            L[i] = 0
        return _F0
    iscale = _F32(_F32(nmax) / mx)
    for i in range(n):
        L[i] = nearest_int(_F32(iscale * x[i])) & 0xFF
    scale = _F32(_F1 / iscale)
    best = _F0
    for i in range(n):
        diff = _F32(x[i] - _F32(scale * _F32(L[i])))
        best = _F32(best + _F32(_F32(qw[i] * diff) * diff))
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = _F32(_F32(_F32(_TENTH * _F32(step)) + _F32(nmax)) / mx)
        scale_is = _F32(_F1 / iscale_is)
        mse = _F0
        for i in range(n):
            li = min(nmax, nearest_int(_F32(iscale_is * x[i])))
            diff = _F32(x[i] - _F32(scale_is * _F32(li)))
            mse = _F32(mse + _F32(_F32(qw[i] * diff) * diff))
        if mse < best:
            best = mse
            iscale = iscale_is
    sumlx = _F0
    suml2 = _F0
    for i in range(n):
        li = min(nmax, nearest_int(_F32(iscale * x[i])))
        L[i] = li & 0xFF
        fl = _F32(li)
        sumlx = _F32(sumlx + _F32(_F32(qw[i] * x[i]) * fl))
        suml2 = _F32(suml2 + _F32(_F32(qw[i] * fl) * fl))
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = qw[i]
            old = _F32(L[i])
            slx = _F32(sumlx - _F32(_F32(w * x[i]) * old))
            sl2 = _F32(suml2 - _F32(_F32(w * old) * old))
            if slx > _F0 and sl2 > _F0:
                new_l = min(nmax, nearest_int(_F32(_F32(x[i] * sl2) / slx)))
                if new_l != L[i]:
                    fn = _F32(new_l)
                    slx = _F32(slx + _F32(_F32(w * x[i]) * fn))
                    sl2 = _F32(sl2 + _F32(_F32(w * fn) * fn))
                    if _F32(_F32(slx * slx) * suml2) > _F32(_F32(sumlx * sumlx) * sl2):
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return _F32(sumlx / suml2) if suml2 > _F0 else _F0


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def qx(x, nmax, L, qw):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw): L holds codes + nmax."""
    n = x.shape[0]
    mx = _F0
    amax = _F0
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < _EPS:
        for i in range(n):
            L[i] = 0
        return _F0
    iscale = _F32(_F32(-nmax) / mx)
    sumlx = _F0
    suml2 = _F0
    for i in range(n):
        li = max(-nmax, min(nmax - 1, nearest_int(_F32(iscale * x[i]))))
        L[i] = li + nmax
        fl = _F32(li)
        sumlx = _F32(sumlx + _F32(_F32(qw[i] * x[i]) * fl))
        suml2 = _F32(suml2 + _F32(_F32(qw[i] * fl) * fl))
    scale = _F32(sumlx / suml2) if suml2 != _F0 else _F0
    best = _F32(scale * sumlx)
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = _F32(-_F32(_F32(nmax) + _F32(_TENTH * _F32(step))) / mx)
        sumlx = _F0
        suml2 = _F0
        for i in range(n):
            fl = _F32(max(-nmax, min(nmax - 1, nearest_int(_F32(iscale * x[i])))))
            sumlx = _F32(sumlx + _F32(_F32(qw[i] * x[i]) * fl))
            suml2 = _F32(suml2 + _F32(_F32(qw[i] * fl) * fl))
        if suml2 > _F0 and _F32(sumlx * sumlx) > _F32(best * suml2):
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(_F32(iscale * x[i]))))
            scale = _F32(sumlx / suml2)
            best = _F32(scale * sumlx)
    return scale


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _weights(x, qw, sigma2, w):
    """w[l] = qw[l] * sqrtf(sigma2 + x[l]*x[l]); returns their sum in order."""
    s = _F0
    for i in range(x.shape[0]):
        w[i] = _F32(qw[i] * _F32(np.sqrt(_F32(sigma2 + _F32(x[i] * x[i])))))
        s = _F32(s + w[i])
    return s


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _sum_x2(x):
    s = _F0
    for i in range(x.shape[0]):
        s = _F32(s + _F32(x[i] * x[i]))
    return s


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _legacy_row(x, qw, o, kind, w, L, Laux):
    """quantize_row_q{4,5}_{0,1}_impl on one row x with quant_weights qw into o."""
    n = x.shape[0]
    sigma2 = _F32(_sum_x2(x) / _F32(n))
    size = (18, 20, 22, 24)[kind]
    for ib in range(n // 32):
        xb = x[32 * ib : 32 * ib + 32]
        ob = o[size * ib : size * ib + size]
        _weights(xb, qw[32 * ib : 32 * ib + 32], sigma2, w)
        if kind == 0 or kind == 2:
            d = qx(xb, 8 if kind == 0 else 16, L, w)
            put_fp16(ob, 0, d)
            at = 2
        else:
            d, the_min = qkx3(xb, w, 15 if kind == 1 else 31, L, Laux)
            put_fp16(ob, 0, d)
            put_fp16(ob, 2, -the_min)
            at = 4
        if kind >= 2:
            qh = 0
            for j in range(32):
                qh |= ((L[j] >> 4) & 1) << j
            for k in range(4):
                ob[at + k] = (qh >> (8 * k)) & 0xFF
            at += 4
        for j in range(16):
            ob[at + j] = ((L[j] & 0xF) | ((L[j + 16] & 0xF) << 4)) & 0xFF


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _q45_k_block(x, qw, o, nmax, w, L, Laux, scales, mins, sw, Ls, Lm):
    """quantize_row_q{4,5}_K_impl on one super-block."""
    sigma2 = _F32(_F32(_F32(2.0) * _sum_x2(x)) / _F32(256.0))
    for j in range(8):
        sw[j] = _weights(x[32 * j : 32 * j + 32], qw[32 * j : 32 * j + 32], sigma2, w)
        s, m = qkx3(x[32 * j : 32 * j + 32], w, nmax, L[32 * j : 32 * j + 32], Laux)
        scales[j] = s
        mins[j] = m
    d_block = qp(scales, sw, 63, Ls)
    m_block = qp(mins, sw, 63, Lm)
    for k in range(12):
        o[4 + k] = 0
    for j in range(8):
        ls = Ls[j]
        lm = Lm[j]
        if nmax == 31:
            ls = min(63, ls)
            lm = min(63, lm)
        if j < 4:
            o[4 + j] = ls
            o[4 + j + 4] = lm
        else:
            o[4 + j + 4] = ((ls & 0xF) | ((lm & 0xF) << 4)) & 0xFF
            o[4 + j - 4] |= ((ls >> 4) << 6) & 0xFF
            o[4 + j] |= ((lm >> 4) << 6) & 0xFF
    put_fp16(o, 0, d_block)
    put_fp16(o, 2, m_block)
    d_all = get_fp16(o, 0)
    dmin_all = get_fp16(o, 2)
    for j in range(8):
        if j < 4:
            sc = o[4 + j] & 63
            m = o[4 + j + 4] & 63
        else:
            sc = (o[4 + j + 4] & 0xF) | ((o[4 + j - 4] >> 6) << 4)
            m = (o[4 + j + 4] >> 4) | ((o[4 + j] >> 6) << 4)
        d = _F32(d_all * _F32(sc))
        if d == _F0:
            continue
        dm = _F32(dmin_all * _F32(m))
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, nearest_int(_F32(_F32(x[32 * j + i] + dm) / d))))
    qs_at = 16 if nmax == 15 else 48
    if nmax == 31:
        for k in range(32):
            o[16 + k] = 0
    for ch in range(4):
        for k in range(32):
            l1 = L[64 * ch + k]
            l2 = L[64 * ch + 32 + k]
            if nmax == 31:
                if l1 > 15:
                    l1 -= 16
                    o[16 + k] |= 1 << (2 * ch)
                if l2 > 15:
                    l2 -= 16
                    o[16 + k] |= 2 << (2 * ch)
            o[qs_at + 32 * ch + k] = (l1 | (l2 << 4)) & 0xFF


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _pack_2bit(L, o, at):
    for h in range(2):
        for k in range(32):
            e = 128 * h + k
            o[at + 32 * h + k] = (
                L[e] | (L[e + 32] << 2) | (L[e + 64] << 4) | (L[e + 96] << 6)
            ) & 0xFF


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _q2_k_block(x, qw, o, w, L, Laux, scales, mins, sw, Ls, Lm):
    """quantize_row_q2_K_impl on one super-block: scales[16], qs[64], d, dmin."""
    sigma2 = _F32(_sum_x2(x) / _F32(256.0))
    for j in range(16):
        sw[j] = _weights(x[16 * j : 16 * j + 16], qw[16 * j : 16 * j + 16], sigma2, w)
        s, m = qkx3(x[16 * j : 16 * j + 16], w[:16], 3, L[16 * j : 16 * j + 16], Laux)
        scales[j] = s
        mins[j] = m
    dm = qp(scales, sw, 15, Ls)
    mm = qp(mins, sw, 15, Lm)
    put_fp16(o, 80, dm)
    put_fp16(o, 82, mm)
    dm = get_fp16(o, 80)
    mm = get_fp16(o, 82)
    for j in range(16):
        o[j] = (Ls[j] | (Lm[j] << 4)) & 0xFF
    for j in range(16):
        d = _F32(dm * _F32(o[j] & 0xF))
        if d == _F0:
            continue
        m = _F32(mm * _F32(o[j] >> 4))
        for i in range(16):
            L[16 * j + i] = max(0, min(3, nearest_int(_F32(_F32(x[16 * j + i] + m) / d))))
    _pack_2bit(L, o, 16)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _q3_k_block(x, qw, o, w, L, scales, sw, Ls):
    """quantize_row_q3_K_impl on one super-block: hmask[32], qs[64], scales[12], d."""
    sigma2 = _F32(_F32(_F32(2.0) * _sum_x2(x)) / _F32(256.0))
    for j in range(16):
        sw[j] = _weights(x[16 * j : 16 * j + 16], qw[16 * j : 16 * j + 16], sigma2, w)
        scales[j] = qx(x[16 * j : 16 * j + 16], 4, L[16 * j : 16 * j + 16], w[:16])
    for k in range(12):
        o[96 + k] = 0
    d_block = qx(scales, 32, Ls, sw)
    for j in range(16):
        lv = Ls[j]
        if j < 8:
            o[96 + j] = lv & 0xF
        else:
            o[96 + j - 8] |= (lv & 0xF) << 4
        lv >>= 4
        o[96 + j % 4 + 8] |= (lv << (2 * (j // 4))) & 0xFF
    put_fp16(o, 108, d_block)
    d_all = get_fp16(o, 108)
    for j in range(16):
        d = _F32(d_all * _F32(Ls[j] - 32))
        if d == _F0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-4, min(3, nearest_int(_F32(x[16 * j + i] / d)))) + 4
    for k in range(32):
        o[k] = 0
    for j in range(256):
        if L[j] > 3:
            o[j % 32] |= 1 << (j // 32)
            L[j] -= 4
    _pack_2bit(L, o, 32)


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _q6_k_block(x, qw, o, L, scales):
    """quantize_row_q6_K_impl on one super-block: ql[128], qh[64], scales[16], d."""
    max_scale = _F0
    max_abs = _F0
    for ib in range(16):
        s = qx(x[16 * ib : 16 * ib + 16], 32, L[16 * ib : 16 * ib + 16], qw[16 * ib : 16 * ib + 16])
        scales[ib] = s
        if abs(s) > max_abs:
            max_abs = abs(s)
            max_scale = s
    if max_abs < _EPS:
        for k in range(210):
            o[k] = 0
        return
    iscale = _F32(_F32(-128.0) / max_scale)
    put_fp16(o, 208, _F32(_F1 / iscale))
    d_all = get_fp16(o, 208)
    for ib in range(16):
        o[192 + ib] = min(127, nearest_int(_F32(iscale * scales[ib]))) & 0xFF
    for j in range(16):
        sc = o[192 + j]
        d = _F32(d_all * _F32(sc - 256 if sc >= 128 else sc))
        if d == _F0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-32, min(31, nearest_int(_F32(x[16 * j + i] / d)))) + 32
    for h in range(2):
        for k in range(32):
            e = 128 * h + k
            q1, q2, q3, q4 = L[e], L[e + 32], L[e + 64], L[e + 96]
            o[64 * h + k] = ((q1 & 0xF) | ((q3 & 0xF) << 4)) & 0xFF
            o[64 * h + 32 + k] = ((q2 & 0xF) | ((q4 & 0xF) << 4)) & 0xFF
            qh = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
            o[128 + 32 * h + k] = qh & 0xFF


@numba.njit(cache=True, fastmath=False, error_model="numpy")
def _row(x, qw, o, kind):
    """One row with quant_weights: ggml's quantize_<type> of a row of n elements."""
    w = np.empty(32, np.float32)
    L = np.zeros(256, np.int64)
    Laux = np.empty(32, np.int64)
    scales = np.empty(16, np.float32)
    mins = np.empty(16, np.float32)
    sw = np.empty(16, np.float32)
    Ls = np.empty(16, np.int64)
    Lm = np.empty(16, np.int64)
    if kind < 10:
        _legacy_row(x, qw, o, kind, w, L, Laux)
        return
    size = (84, 110, 144, 176, 210)[kind - 10]
    for i in range(x.shape[0] // 256):
        xb = x[256 * i : 256 * i + 256]
        wb = qw[256 * i : 256 * i + 256]
        ob = o[size * i : size * i + size]
        if kind == 10:
            _q2_k_block(xb, wb, ob, w, L, Laux, scales, mins, sw, Ls, Lm)
        elif kind == 11:
            _q3_k_block(xb, wb, ob, w, L, scales, sw, Ls)
        elif kind == 14:
            _q6_k_block(xb, wb, ob, L, scales)
        else:
            _q45_k_block(xb, wb, ob, 15 if kind == 12 else 31, w, L, Laux,
                         scales[:8], mins[:8], sw[:8], Ls[:8], Lm[:8])  # fmt: skip


@numba.njit(cache=True, fastmath=False, parallel=True, error_model="numpy")
def quantize_weighted(rows, qw, out, kind):
    """rows (r, n) float32, qw (n,) float32 -> out (r, row_bytes) uint8, rows in parallel."""
    for r in prange(rows.shape[0]):
        _row(rows[r], qw, out[r], kind)
