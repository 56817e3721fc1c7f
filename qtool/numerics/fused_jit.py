"""The numba bodies of the fused CPU kernels (entry points and contract: numerics/fused.py).

Every function that computes a range, a qparam or a code is compiled with fastmath off (no
reciprocal, no contraction, no reassociation), so it gives the torch kernels' bits whatever the
CPU; only the mse search's candidate sums (`_seg_sse`) allow reassociation, which changes nothing
but the order of float64 adds. The error figures are the canonical chunk sums of
numerics/fused_sums.py (metrics.py's definition): errors are measured on x_hat rounded to the
input's dtype, and each chunk is summed by one thread in a fixed order. Min/max run on integer
keys that order like the floats, because float min/max reductions do not vectorise without
fast-math.

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

from qtool.numerics.fused_sums import CHUNK, chunk_span, chunk_sums, fold_squares
from qtool.numerics.fused_words import (
    f32_to_bf16,
    f32_to_half,
    half_to_f32,
    key,
    restore,
    to_f32,
    unkey,
)

_TINY = np.float32(np.finfo(np.float32).tiny)
OK, NONFINITE, OVERFLOW = 0, 1, 2
SCALE_F32, SCALE_BF16, SCALE_F16 = 0, 1, 2

# ---------------------------------------------------------------- scalar helpers


@numba.njit(cache=True, fastmath=False)
def _seg_keys(xs):
    """(min key, max key) of a 1-D run, both starting from 0.0 so the range holds 0."""
    klo = np.int32(0)
    khi = np.int32(0)
    for i in range(xs.size):
        k = key(to_f32(xs[i]))
        klo = min(klo, k)
        khi = max(khi, k)
    return klo, khi


@numba.njit(cache=True, fastmath=False)
def _round_scale(scale, kind):
    """ranges.round_scale: clamp into the dtype's [smallest subnormal, max], round, widen."""
    if kind == SCALE_BF16:
        s = min(max(scale, np.float32(2.0**-133)), np.float32(3.3895313892515355e38))
        return np.uint32(np.uint32(f32_to_bf16(s)) << 16).view(np.float32)
    if kind == SCALE_F16:
        s = min(max(scale, np.float32(2.0**-24)), np.float32(65504.0))
        return half_to_f32(np.int16(np.uint16(f32_to_half(s))))
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
    """cs = clamp(rint(x / scale) + zp, qmin, qmax); with_err, es = x - x_hat as restored
    (x_hat = (q - zp) * scale in float32, rounded to the input's dtype)."""
    for i in range(xs.size):
        v = to_f32(xs[i])
        t = min(max(np.float32(np.rint(np.float32(v / scale)) + zp), qmin), qmax)
        cs[i] = t
        if with_err:
            es[i] = v - restore(np.float32(np.float32(t - zp) * scale), xs[i])


@numba.njit(cache=True, fastmath=False)
def _restored_errs(xs, scale, zp, qmin, qmax, es):
    """es = x - x_hat as restored for the codes (scale, zp) give (not stored)."""
    for i in range(xs.size):
        v = to_f32(xs[i])
        t = min(max(np.float32(np.rint(np.float32(v / scale)) + zp), qmin), qmax)
        es[i] = v - restore(np.float32(np.float32(t - zp) * scale), xs[i])


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
        xf[i] = to_f32(xs[i])


@numba.njit(cache=True, fastmath=False)
def _cand_errs(xf, n, scale, zp, qmin, qmax, es):
    """es[:n] = x - (q - zp) * scale for the codes q of one candidate (no codes stored)."""
    for i in range(n):
        v = xf[i]
        t = min(max(np.float32(np.rint(np.float32(v / scale)) + zp), qmin), qmax)
        es[i] = v - np.float32(np.float32(t - zp) * scale)


@numba.njit(cache=True, fastmath=False)
def _seg_search(xs, lo, hi, grid, cands, xf, es):
    """--range mse for one group: (scale, zp, choice, min-max's scale and zp, status); candidate
    0 is min-max, a candidate wins only with a strictly smaller float64 sum of squared errors,
    and a candidate whose widened range overflows is skipped (ranges._candidate_qparams: NaN)."""
    s0, z0, st = qparams(lo, hi, grid)
    if st != OK:
        return s0, z0, 0, s0, z0, st
    qmin, qmax = grid[2], grid[3]
    n = xs.size
    _seg_decode(xs, xf)
    _cand_errs(xf, n, s0, z0, qmin, qmax, es)
    best = _seg_sse(es, n)
    bs, bz, bk = s0, z0, 0
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
    return bs, bz, bk, s0, z0, OK


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
def rows_kernel(x2, gsize, grid, cands, codes2, out, status, with_err, pack, parts, kmax):
    """Groups of gsize along each row of x2 [C, K]: qparams, codes, error sums.

    out = (scale2, zp2 [C, n_groups] float32, choice2 uint8); cands: the mse multipliers (size
    0: min-max). pack = (width, offset, packed [C, K / width * wp]) with width 0 for unpacked
    codes into codes2 [C, K] (else codes2 is a [1, K] template). parts: the chunk sums of x^2,
    e^2 and (mse) min-max's e^2; kmax: the largest |e| key per thread (an argument of its own:
    numba 0.6x loses writes to an array unpacked from a tuple inside a prange). A thread owns
    whole units of rows (fused_sums.py), so chunks never cross threads; a chunk's errors wait
    in a window until it is complete (a group longer than a chunk is coded piece by piece).
    """
    scale2, zp2, choice2 = out
    qmin, qmax = grid[2], grid[3]
    width, offset, packed = pack
    rows, k = x2.shape
    x1 = x2.reshape(-1)
    per_unit = max(1, CHUNK // k) if k <= CHUNK else 1
    nck = 1 if k <= CHUNK else (k + CHUNK - 1) // CHUNK
    units = (rows + per_unit - 1) // per_unit
    nch = kmax.size
    search = cands.size > 0
    for ch in prange(nch):
        n = min(gsize, k)
        es = np.empty(n if search else 0, np.float32)  # the search's candidate errors
        xf = np.empty(n if search else 0, np.float32)
        win = np.empty(CHUNK, np.float32)  # the errors of the chunk being filled
        winm = np.empty(CHUNK if search and with_err else 0, np.float32)  # min-max's
        buf = np.empty(CHUNK // 2, np.float64)
        tmp = codes2[0].copy()
        km = np.int32(0)
        for u in range(ch * units // nch, (ch + 1) * units // nch):
            c = u * nck  # the unit's first chunk
            r0 = u * per_unit
            r1 = min(r0 + per_unit, rows)
            for r in range(r0, r1):
                cr = tmp if width else codes2[r]
                # where row r's errors go in the window: after the unit's earlier rows, or
                # (rows longer than a chunk) from the start of the chunk being filled
                base = (r - r0) * k if nck == 1 else 0
                start = 0  # the chunk being filled starts at this column (nck > 1)
                for g in range(scale2.shape[1]):
                    a, b = g * gsize, min(g * gsize + gsize, k)
                    xs = x2[r, a:b]
                    klo, khi = _seg_keys(xs)
                    s0, z0 = np.float32(0.0), np.float32(0.0)
                    if search:
                        s, z, ci, s0, z0, st = _seg_search(
                            xs, unkey(klo), unkey(khi), grid, cands, xf, es
                        )
                        choice2[r, g] = ci
                    else:
                        s, z, st = qparams(unkey(klo), unkey(khi), grid)
                    status[r] = max(status[r], st)
                    scale2[r, g], zp2[r, g] = s, z
                    if st != OK:  # no codes (the call raises): the walk of the chunks goes on
                        while nck > 1 and start < k and min(k, start + CHUNK) <= b:
                            start = min(k, start + CHUNK)
                            c += 1
                        continue
                    p = a
                    while p < b:
                        end = min(k, start + CHUNK) if nck > 1 else k
                        q = min(b, end)
                        w0, w1 = base + p - start, base + q - start
                        _seg_codes(x2[r, p:q], s, z, qmin, qmax, cr[p:q], win[w0:w1], with_err)
                        if search and with_err:
                            _restored_errs(x2[r, p:q], s0, z0, qmin, qmax, winm[w0:w1])
                        if q == end and nck > 1:  # a chunk of a long row is done
                            if with_err:
                                done = x1[r * k + start : r * k + end]
                                km = max(km, _sums_of(done, win, winm, end - start, buf, c, parts,
                                                      search))  # fmt: skip
                            c += 1
                            start = end
                        p = q
                if width:
                    _pack_rows(cr, packed[r], width, offset, zp2[r], gsize)
            if nck == 1 and with_err:  # the unit is one chunk
                n_unit = (r1 - r0) * k
                km = max(km, _sums_of(x1[r0 * k : r1 * k], win, winm, n_unit, buf, c, parts,
                                      search))  # fmt: skip
        kmax[ch] = km


@numba.njit(cache=True, fastmath=False)
def _sums_of(xs, win, winm, n, buf, c, parts, search):
    """A complete chunk's sums into its slots (and min-max's with the search); max |e| key."""
    if search:
        parts[2][c] = fold_squares(winm, n, buf)
    return chunk_sums(xs, win, n, buf, c, parts)


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
        lo, hi = unkey(klo[:, c].min()), unkey(khi[:, c].max())
        scale[c], zp[c], st = qparams(lo, hi, grid)
        worst = max(worst, st)
    return worst


@numba.njit(parallel=True, cache=True, fastmath=False)
def segs_codes(x1, seg, grid, scale, zp, codes1, with_err, lay, parts, kmax):
    """Codes and error sums of runs of `seg` elements, qparams index = run number mod nq,
    walked chunk by chunk (lay: the tensor's chunks; parts, kmax: as rows_kernel)."""
    qmin, qmax = grid[2], grid[3]
    nq = scale.size
    nchunks = lay[3]
    nch = kmax.size
    for ch in prange(nch):
        es = np.empty(CHUNK, np.float32)
        buf = np.empty(CHUNK // 2, np.float64)
        km = np.int32(0)
        for c in range(ch * nchunks // nch, (ch + 1) * nchunks // nch):
            a, b = chunk_span(c, lay, x1.size)
            p = a
            while p < b:
                s = p // seg
                q = min(b, s * seg + seg)
                i = s % nq
                _seg_codes(x1[p:q], scale[i], zp[i], qmin, qmax, codes1[p:q], es[p - a : q - a],
                           with_err)  # fmt: skip
                p = q
            if with_err:
                km = max(km, chunk_sums(x1[a:b], es, b - a, buf, c, parts))
        kmax[ch] = km


@numba.njit(parallel=True, cache=True, fastmath=False)
def pack_flat(codes1, width, offset, seg, zp, packed):
    """Pack flat codes by last-dim rows; an odd row is padded with its last element's zp."""
    nrows = codes1.size // width
    wp = (width + 1) // 2
    for j in prange(nrows):
        pad_j = zp[(((j + 1) * width - 1) // seg) % zp.size]
        _pack_run(codes1[j * width : (j + 1) * width], packed[j * wp : (j + 1) * wp], offset, pad_j)


@numba.njit(cache=True, fastmath=False)
def _col_codes(xs, col, scale, zp, qmin, qmax, cs, es, with_err):
    """_seg_codes with per-column qparams: element i is column (col + i) mod scale.size."""
    width = scale.size
    for i in range(xs.size):
        v = to_f32(xs[i])
        t = min(max(np.float32(np.rint(np.float32(v / scale[col])) + zp[col]), qmin), qmax)
        cs[i] = t
        if with_err:
            es[i] = v - restore(np.float32(np.float32(t - zp[col]) * scale[col]), xs[i])
        col += 1
        if col == width:
            col = 0


@numba.njit(parallel=True, cache=True, fastmath=False)
def cols_keys(x2, nch):
    """Min/max keys of every column of x2 [pre, W], as (nch, W) partials."""
    rows, width = x2.shape
    klo = np.zeros((nch, width), np.int32)
    khi = np.zeros((nch, width), np.int32)
    for ch in prange(nch):
        for i in range(ch * rows // nch, (ch + 1) * rows // nch):
            for j in range(width):
                k = key(to_f32(x2[i, j]))
                klo[ch, j] = min(klo[ch, j], k)
                khi[ch, j] = max(khi[ch, j], k)
    return klo, khi


@numba.njit(parallel=True, cache=True, fastmath=False)
def cols_codes(x1, scale, zp, grid, codes1, with_err, lay, parts, kmax):
    """Codes and error sums of x1 (flat rows of W elements) with per-column qparams scale/zp
    [W], walked chunk by chunk (lay: the tensor's chunks; parts, kmax: as rows_kernel)."""
    qmin, qmax = grid[2], grid[3]
    nchunks = lay[3]
    nch = kmax.size
    for ch in prange(nch):
        es = np.empty(CHUNK, np.float32)
        buf = np.empty(CHUNK // 2, np.float64)
        km = np.int32(0)
        for c in range(ch * nchunks // nch, (ch + 1) * nchunks // nch):
            a, b = chunk_span(c, lay, x1.size)
            _col_codes(x1[a:b], a % scale.size, scale, zp, qmin, qmax, codes1[a:b], es, with_err)
            if with_err:
                km = max(km, chunk_sums(x1[a:b], es, b - a, buf, c, parts))
        kmax[ch] = km


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
            out[i] = np.uint16(f32_to_bf16(f))  # (q - zp) * scale is never NaN

        return store_bf16
    if dtype == types.int16:

        def store_f16(out, i, f):
            out[i] = np.int16(np.uint16(f32_to_half(f)))

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
