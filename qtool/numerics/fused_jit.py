"""The numba bodies of the fused CPU kernels (entry points and contract: numerics/fused.py).

Every function that computes a range, a qparam or a code is compiled with fastmath off (no
reciprocal, no contraction, no reassociation), so it gives the torch kernels' bits whatever the
CPU; only the error sums (`_seg_sums`, `_seg_sse`) allow reassociation, which changes nothing
but the order of float64 adds. Min/max run on integer keys that order like the floats, because
float min/max reductions do not vectorise without fast-math.

Layouts: a tensor is either [C, K] rows cut into groups of G (per channel on axis 0 is G = K),
or a flat run of segments of L elements whose qparams index cycles through C (per channel on
another axis: L = post; per tensor: C = 1, L = a block), or [pre, C * post] rows whose columns
carry their own qparams (per channel on an axis with a short `post`).

`grid` tuples are (sym, divisor, qmin, qmax, zp_sym, scale_kind) with scale_kind 0 float32,
1 bfloat16, 2 float16: the dtype the scale is rounded to before the codes are computed.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

_TINY = np.float32(np.finfo(np.float32).tiny)
OK, NONFINITE, OVERFLOW = 0, 1, 2
SCALE_F32, SCALE_BF16, SCALE_F16 = 0, 1, 2

# ---------------------------------------------------------------- scalar helpers


def _to_f32(v):
    """The float32 value of one input element (specialised on its numba type)."""
    raise NotImplementedError  # only called from jitted code


@overload(_to_f32, jit_options={"fastmath": False})
def _to_f32_impl(v):
    if v == types.float32:
        return lambda v: v
    if v == types.float64:
        return lambda v: np.float32(v)  # round to nearest even, as torch's .float()
    if v == types.uint16:  # bf16: the top half of a float32
        return lambda v: np.uint32(np.uint32(v) << 16).view(np.float32)
    if v == types.int16:  # fp16 words
        return lambda v: _half_to_f32(v)
    return None


@numba.njit(inline="always", cache=True, fastmath=False)
def _half_to_f32(v):
    """Exact fp16 -> fp32 from the 16-bit word (numba has no float16 on CPU)."""
    h = np.int64(v) & 0xFFFF
    o = (h & 0x7FFF) << 13
    exp = o & 0x0F800000
    o += 0x38000000  # rebias 15 -> 127
    if exp == 0x0F800000:
        o += 0x38000000  # Inf/NaN keep an all-ones exponent
    elif exp == 0:  # subnormal: let the FPU normalise it (exact)
        o += 0x00800000
        f = np.float32(np.uint32(o).view(np.float32) - np.float32(6.103515625e-05))
        o = np.int64(f.view(np.uint32))
    o |= (h & 0x8000) << 16
    return np.uint32(o).view(np.float32)


@numba.njit(inline="always", cache=True, fastmath=False)
def _key(f):
    """int32 that orders like the float32 f (-0.0 just below +0.0)."""
    b = np.float32(f).view(np.int32)
    return np.int32(b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF)))


@numba.njit(inline="always", cache=True, fastmath=False)
def _unkey(k):
    return np.int32(k ^ ((k >> np.int32(31)) & np.int32(0x7FFFFFFF))).view(np.float32)


@numba.njit(cache=True, fastmath=False)
def _seg_keys(xs):
    """(min key, max key) of a 1-D run, both starting from 0.0 so the range holds 0."""
    klo = np.int32(0)
    khi = np.int32(0)
    for i in range(xs.size):
        k = _key(_to_f32(xs[i]))
        klo = min(klo, k)
        khi = max(khi, k)
    return klo, khi


@numba.njit(inline="always", cache=True, fastmath=False)
def _f32_to_half(f):
    """fp32 -> fp16 word, round to nearest even, overflow to Inf (F. Giesen's rtne method)."""
    u = np.int64(np.float32(f).view(np.uint32))
    sign = u & 0x80000000
    u ^= sign
    if u >= 0x47800000:  # >= 65536 before rounding: Inf (or NaN)
        o = np.int64(0x7E00 if u > 0x7F800000 else 0x7C00)
    elif u < 0x38800000:  # result is subnormal or zero: the FPU rounds it when adding 0.5
        f = np.float32(np.uint32(u).view(np.float32) + np.float32(0.5))
        o = np.int64(f.view(np.uint32))
        o -= 0x3F000000
    else:
        u += -0x38000000 + 0xFFF + ((u >> 13) & 1)
        o = u >> 13
    return o | (sign >> 16)


@numba.njit(inline="always", cache=True, fastmath=False)
def _f32_to_bf16(f):
    """fp32 -> bf16 word, round to nearest even (finite inputs)."""
    b = np.int64(np.float32(f).view(np.uint32))
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16


@numba.njit(cache=True, fastmath=False)
def _round_scale(scale, kind):
    """ranges.round_scale: clamp into the dtype's [smallest subnormal, max], round, widen."""
    if kind == SCALE_BF16:
        s = min(max(scale, np.float32(2.0**-133)), np.float32(3.3895313892515355e38))
        return np.uint32(np.uint32(_f32_to_bf16(s)) << 16).view(np.float32)
    if kind == SCALE_F16:
        s = min(max(scale, np.float32(2.0**-24)), np.float32(65504.0))
        return _half_to_f32(np.int16(np.uint16(_f32_to_half(s))))
    return scale


@numba.njit(cache=True, fastmath=False)
def _finish(scale, span, lo, grid):
    """(scale, zero point as float32) from a finite raw scale, as ranges._finish."""
    sym, divisor, qmin, qmax, zp_sym, kind = grid
    scale = np.float32(1.0) if span == 0 else max(scale, _TINY)
    scale = _round_scale(scale, kind)
    if sym:
        return scale, zp_sym
    zp = np.float32(qmin - np.rint(np.float32(lo / scale)))
    return scale, min(max(zp, qmin), qmax)


@numba.njit(cache=True, fastmath=False)
def _raw(lo, hi, grid):
    """(raw scale, span, lo clamped to <= 0) as ranges._raw_scale."""
    sym, divisor = grid[0], grid[1]
    if sym:
        span = max(max(hi, -lo), np.float32(0.0))
        return np.float32(span / divisor), span, lo
    lo = min(lo, np.float32(0.0))
    span = np.float32(max(hi, np.float32(0.0)) - lo)
    return np.float32(span / divisor), span, lo


@numba.njit(cache=True, fastmath=False)
def qparams(lo, hi, grid):
    """(scale, zero_point as float32, status) exactly as ranges.qparams_from_range."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return np.float32(1.0), np.float32(0.0), NONFINITE
    scale, span, lo_c = _raw(lo, hi, grid)
    if not np.isfinite(scale):
        return np.float32(1.0), np.float32(0.0), OVERFLOW
    s, z = _finish(scale, span, lo_c, grid)
    return s, z, OK


@numba.njit(cache=True, fastmath=False)
def _seg_codes(xs, scale, zp, qmin, qmax, cs, es, with_err):
    """cs = clamp(rint(x / scale) + zp, qmin, qmax); es = x - (q - zp) * scale if with_err."""
    for i in range(xs.size):
        v = _to_f32(xs[i])
        t = min(max(np.float32(np.rint(np.float32(v / scale)) + zp), qmin), qmax)
        cs[i] = t
        if with_err:
            es[i] = v - np.float32(np.float32(t - zp) * scale)


@numba.njit(cache=True, fastmath={"reassoc"})
def _seg_sums(xs, es):
    """(sum x^2, sum e^2, max |e|) in float64; reassociation only reorders the adds."""
    sx = 0.0
    se = 0.0
    kmax = np.int32(0)
    for i in range(xs.size):
        v = np.float64(_to_f32(xs[i]))
        e = es[i]
        sx += v * v
        se += np.float64(e) * np.float64(e)
        kmax = max(kmax, np.int32(np.float32(e).view(np.int32) & np.int32(0x7FFFFFFF)))
    return sx, se, np.float64(np.int32(kmax).view(np.float32))


@numba.njit(cache=True, fastmath={"reassoc"})
def _seg_sse(es, n):
    """sum e^2 of the first n errors in float64."""
    se = 0.0
    for i in range(n):
        se += np.float64(es[i]) * np.float64(es[i])
    return se


@numba.njit(cache=True, fastmath=False)
def _seg_decode(xs, xf):
    """xf[:n] = the float32 values of the run xs (decoded once for all candidates)."""
    for i in range(xs.size):
        xf[i] = _to_f32(xs[i])


@numba.njit(cache=True, fastmath=False)
def _cand_errs(xf, n, scale, zp, qmin, qmax, es):
    """es[:n] = x - (q - zp) * scale for the codes q of one candidate (no codes stored)."""
    for i in range(n):
        v = xf[i]
        t = min(max(np.float32(np.rint(np.float32(v / scale)) + zp), qmin), qmax)
        es[i] = v - np.float32(np.float32(t - zp) * scale)


@numba.njit(cache=True, fastmath=False)
def _seg_search(xs, lo, hi, grid, cands, xf, es):
    """--range mse for one group: (scale, zp, choice, sse of min-max, status); candidate 0 is
    min-max, a candidate wins only with a strictly smaller float64 sum of squared errors, and a
    candidate whose widened range overflows is skipped (ranges._candidate_qparams: NaN)."""
    s0, z0, st = qparams(lo, hi, grid)
    if st != OK:
        return s0, z0, 0, 0.0, st
    qmin, qmax = grid[2], grid[3]
    n = xs.size
    _seg_decode(xs, xf)
    _cand_errs(xf, n, s0, z0, qmin, qmax, es)
    best = _seg_sse(es, n)
    sse0, bs, bz, bk = best, s0, z0, 0
    for k in range(1, cands.size):
        p = cands[k]
        raw, span, lo_c = _raw(np.float32(lo * p), np.float32(hi * p), grid)
        if not np.isfinite(raw):
            continue
        s, z = _finish(raw, span, lo_c, grid)
        _cand_errs(xf, n, s, z, qmin, qmax, es)
        sse = _seg_sse(es, n)
        if sse < best:
            best, bs, bz, bk = sse, s, z, k
    return bs, bz, bk, sse0, OK


@numba.njit(cache=True, fastmath=False)
def _pack_run(cs, out, offset, pad):
    """Nibbles q + offset, element 2i low and 2i+1 high; an odd run ends with `pad` (a code)."""
    n = cs.size
    for i in range(n // 2):
        out[i] = np.uint8(
            (np.int64(cs[2 * i]) + offset) | ((np.int64(cs[2 * i + 1]) + offset) << 4)
        )
    if n % 2:
        out[n // 2] = np.uint8((np.int64(cs[n - 1]) + offset) | ((np.int64(pad) + offset) << 4))


@numba.njit(cache=True, fastmath=False)
def _pack_rows(cs, out, width, offset, zrow, gsize):
    """Pack a run of whole last-dim rows of `width` codes; an odd row is padded with the zero
    point of the group holding its last element (zrow: the zero points of this [C, K] row)."""
    wp = (width + 1) // 2
    for j in range(cs.size // width):
        pad = zrow[((j + 1) * width - 1) // gsize]
        _pack_run(cs[j * width : (j + 1) * width], out[j * wp : (j + 1) * wp], offset, pad)


# ---------------------------------------------------------------- parallel kernels


@numba.njit(parallel=True, cache=True, fastmath=False)
def rows_kernel(x2, gsize, grid, cands, codes2, out, stats, status, with_err, pack):
    """Groups of gsize along each row of x2 [C, K]: qparams, codes, error sums per row.

    out = (scale2, zp2 [C, n_groups] float32, choice2 uint8, sse0 float64 [C]); cands: the mse
    multipliers (size 0: min-max). pack = (width, offset, packed [C, K / width * wp]) with
    width 0 for unpacked codes into codes2 [C, K] (else codes2 is a [1, K] template).
    """
    scale2, zp2, choice2, sse0 = out
    qmin, qmax = grid[2], grid[3]
    width, offset, packed = pack
    rows, k = x2.shape
    nch = min(rows, 256)
    for ch in prange(nch):
        es = np.empty(min(gsize, k), np.float32)
        xf = np.empty(min(gsize, k) if cands.size else 0, np.float32)
        tmp = codes2[0].copy()
        for r in range(ch * rows // nch, (ch + 1) * rows // nch):
            cr = tmp if width else codes2[r]
            sx, se, em, s0 = 0.0, 0.0, 0.0, 0.0
            for g in range(scale2.shape[1]):
                a, b = g * gsize, min(g * gsize + gsize, k)
                xs = x2[r, a:b]
                klo, khi = _seg_keys(xs)
                if cands.size:
                    s, z, c, e0, st = _seg_search(xs, _unkey(klo), _unkey(khi), grid, cands, xf, es)
                    choice2[r, g] = c
                    s0 += e0
                else:
                    s, z, st = qparams(_unkey(klo), _unkey(khi), grid)
                status[r] = max(status[r], st)
                scale2[r, g], zp2[r, g] = s, z
                if st != OK:
                    continue
                _seg_codes(xs, s, z, qmin, qmax, cr[a:b], es, with_err)
                if with_err:
                    s1, s2, s3 = _seg_sums(xs, es[: b - a])
                    sx, se, em = sx + s1, se + s2, max(em, s3)
            stats[r, 0], stats[r, 1], stats[r, 2] = sx, se, em
            sse0[r] = s0
            if width:
                _pack_rows(cr, packed[r], width, offset, zp2[r], gsize)


@numba.njit(parallel=True, cache=True, fastmath=False)
def segs_keys(x1, seg, nq, nch):
    """Min/max keys per qparam index of runs of `seg` elements whose index cycles mod nq."""
    nseg = (x1.size + seg - 1) // seg
    nrows = (nseg + nq - 1) // nq
    klo = np.zeros((nch, nq), np.int32)
    khi = np.zeros((nch, nq), np.int32)
    for ch in prange(nch):
        for i in range(ch * nrows // nch, (ch + 1) * nrows // nch):
            for c in range(min(nq, nseg - i * nq)):
                off = (i * nq + c) * seg
                lo, hi = _seg_keys(x1[off : min(off + seg, x1.size)])
                klo[ch, c] = min(klo[ch, c], lo)
                khi[ch, c] = max(khi[ch, c], hi)
    return klo, khi


@numba.njit(cache=True, fastmath=False)
def qparams_many(klo, khi, grid, scale, zp):
    """qparams of every index from its (nch, nq) key partials; returns the worst status."""
    worst = 0
    for c in range(scale.size):
        lo, hi = _unkey(klo[:, c].min()), _unkey(khi[:, c].max())
        scale[c], zp[c], st = qparams(lo, hi, grid)
        worst = max(worst, st)
    return worst


@numba.njit(parallel=True, cache=True, fastmath=False)
def segs_codes(x1, seg, grid, scale, zp, codes1, stats, with_err):
    """Codes and error sums of runs of `seg` elements, qparams index = run number mod nq."""
    qmin, qmax = grid[2], grid[3]
    nq = scale.size
    nseg = (x1.size + seg - 1) // seg
    nch = stats.shape[0]
    for ch in prange(nch):
        es = np.empty(min(seg, x1.size), np.float32)
        sx, se, em = 0.0, 0.0, 0.0
        for s in range(ch * nseg // nch, (ch + 1) * nseg // nch):
            a, b = s * seg, min(s * seg + seg, x1.size)
            c = s % nq
            _seg_codes(x1[a:b], scale[c], zp[c], qmin, qmax, codes1[a:b], es, with_err)
            if with_err:
                s1, s2, s3 = _seg_sums(x1[a:b], es[: b - a])
                sx, se, em = sx + s1, se + s2, max(em, s3)
        stats[ch, 0], stats[ch, 1], stats[ch, 2] = sx, se, em


@numba.njit(parallel=True, cache=True, fastmath=False)
def pack_flat(codes1, width, offset, seg, zp, packed):
    """Pack flat codes by last-dim rows; an odd row is padded with its last element's zp."""
    nrows = codes1.size // width
    wp = (width + 1) // 2
    for j in prange(nrows):
        pad_j = zp[(((j + 1) * width - 1) // seg) % zp.size]
        _pack_run(codes1[j * width : (j + 1) * width], packed[j * wp : (j + 1) * wp], offset, pad_j)


@numba.njit(cache=True, fastmath=False)
def _row_codes(xs, scale, zp, qmin, qmax, cs, es, with_err):
    """_seg_codes with one (scale, zp) per element (per channel on a late axis)."""
    for i in range(xs.size):
        v = _to_f32(xs[i])
        t = min(max(np.float32(np.rint(np.float32(v / scale[i])) + zp[i]), qmin), qmax)
        cs[i] = t
        if with_err:
            es[i] = v - np.float32(np.float32(t - zp[i]) * scale[i])


@numba.njit(parallel=True, cache=True, fastmath=False)
def cols_keys(x2, nch):
    """Min/max keys of every column of x2 [pre, W], as (nch, W) partials."""
    rows, width = x2.shape
    klo = np.zeros((nch, width), np.int32)
    khi = np.zeros((nch, width), np.int32)
    for ch in prange(nch):
        for i in range(ch * rows // nch, (ch + 1) * rows // nch):
            for j in range(width):
                k = _key(_to_f32(x2[i, j]))
                klo[ch, j] = min(klo[ch, j], k)
                khi[ch, j] = max(khi[ch, j], k)
    return klo, khi


@numba.njit(parallel=True, cache=True, fastmath=False)
def cols_codes(x2, scale, zp, grid, codes2, stats, with_err):
    """Codes and error sums of x2 [pre, W] with per-column qparams scale/zp [W]."""
    qmin, qmax = grid[2], grid[3]
    rows, width = x2.shape
    nch = stats.shape[0]
    for ch in prange(nch):
        es = np.empty(width, np.float32)
        sx, se, em = 0.0, 0.0, 0.0
        for i in range(ch * rows // nch, (ch + 1) * rows // nch):
            _row_codes(x2[i], scale, zp, qmin, qmax, codes2[i], es, with_err)
            if with_err:
                s1, s2, s3 = _seg_sums(x2[i], es)
                sx, se, em = sx + s1, se + s2, max(em, s3)
        stats[ch, 0], stats[ch, 1], stats[ch, 2] = sx, se, em


# ---------------------------------------------------------------- dequantize


def _store(out, i, f):
    """out[i] = f (float32) converted to out's dtype with round-to-nearest-even."""
    raise NotImplementedError  # only called from jitted code


@overload(_store, jit_options={"fastmath": False})
def _store_impl(out, i, f):
    dtype = out.dtype
    if dtype == types.float32:

        def store_f32(out, i, f):
            out[i] = f

        return store_f32
    if dtype == types.float64:

        def store_f64(out, i, f):
            out[i] = np.float64(f)

        return store_f64
    if dtype == types.uint16:

        def store_bf16(out, i, f):
            out[i] = np.uint16(_f32_to_bf16(f))  # (q - zp) * scale is never NaN

        return store_bf16
    if dtype == types.int16:

        def store_f16(out, i, f):
            out[i] = np.int16(np.uint16(_f32_to_half(f)))

        return store_f16
    return None


@numba.njit(parallel=True, cache=True, fastmath=False)
def dq_rows(q2, gsize, scale2, zp2, out2):
    """out2[r, i] = (q - zp) * scale of i's group, in float32, stored as out2's dtype."""
    rows, k = q2.shape
    for r in prange(rows):
        orow = out2[r]
        for g in range(scale2.shape[1]):
            s, z = scale2[r, g], zp2[r, g]
            for i in range(g * gsize, min(g * gsize + gsize, k)):
                _store(orow, i, np.float32(np.float32(q2[r, i]) - z) * s)


@numba.njit(parallel=True, cache=True, fastmath=False)
def dq_segs(q1, seg, scale, zp, out1):
    """Runs of `seg` codes, qparams index = run number mod scale.size."""
    nseg = (q1.size + seg - 1) // seg
    for sg in prange(nseg):
        c = sg % scale.size
        s, z = scale[c], zp[c]
        for i in range(sg * seg, min(sg * seg + seg, q1.size)):
            _store(out1, i, np.float32(np.float32(q1[i]) - z) * s)


@numba.njit(parallel=True, cache=True, fastmath=False)
def unpack_flat(packed, width, offset, codes1):
    """Inverse of the packing: codes1 (flat, storage dtype) from nibbles q + offset."""
    wp = (width + 1) // 2
    for j in prange(codes1.size // width):
        for i in range(width):
            byte = np.int64(packed[j * wp + i // 2])
            codes1[j * width + i] = ((byte >> (4 * (i % 2))) & 0xF) - offset
