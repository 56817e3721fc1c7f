"""The canonical error sums of the fused CPU kernels (numba): numerics/metrics.py's definition.

A tensor is cut into chunks (metrics.py: units of whole [C, K] rows, long rows in pieces of CHUNK
elements); the float64 squares of a chunk are summed by folding in halves, and the chunk sums are
written to an array (one slot per chunk) that Python adds exactly (math.fsum). A kernel thread owns
whole chunks, so the sums do not depend on the thread count. Compiled with fastmath off: the fold
is a fixed tree of float64 adds (it vectorises as it is: the adds of a level are independent),
its first three levels taken straight from the chunk's values (in cache: the kernel just wrote
them), eight at a time, so only an eighth of the chunk goes through memory.

`lay` tuples are (K, chunks per unit, elements per unit, chunks): see `layout` in fused.py.
Importing this module imports numba; numerics/select.py decides whether that happens.
"""

from __future__ import annotations

import numba
import numpy as np

from qtool.numerics.fused_words import to_f32

CHUNK = 1024  # metrics.CHUNK


@numba.njit(inline="always", cache=True, fastmath=False)
def _sq(v):
    a = np.float64(to_f32(v))
    return a * a


@numba.njit(inline="always", cache=True, fastmath=False)
def _sq_at(vals, i, n):
    """vals[i]^2, or 0.0 past the end (the zero padding of the definition)."""
    return _sq(vals[i]) if i < n else 0.0


@numba.njit(cache=True, fastmath=False)
def fold_squares(vals, n, buf):
    """sum vals[:n]^2 in float64 (vals: input words or float32 errors), folded in halves over
    the next power of two P (zero-padded). The first three levels are taken from vals directly,
    eight values at a time: s[i] = ((v[i]^2 + v[i+4e]^2) + (v[i+2e]^2 + v[i+6e]^2))
    + ((v[i+e]^2 + v[i+5e]^2) + (v[i+3e]^2 + v[i+7e]^2)), e = P / 8, exactly the three levels'
    adds; the rest folds in buf (at least CHUNK // 8 float64)."""
    p = 1
    while p < n:
        p *= 2
    if p < 8:  # P <= 4: the same tree, in buf
        for i in range(p):
            buf[i] = _sq_at(vals, i, n)
        while p > 1:
            p //= 2
            for i in range(p):
                buf[i] += buf[i + p]
        return buf[0]
    e = p // 8
    full = min(e, max(0, n - 7 * e))  # all eight values present (v[i + 3e] always is: n > 4e)
    for i in range(full):
        a0 = _sq(vals[i]) + _sq(vals[i + 4 * e])
        a1 = _sq(vals[i + e]) + _sq(vals[i + 5 * e])
        a2 = _sq(vals[i + 2 * e]) + _sq(vals[i + 6 * e])
        a3 = _sq(vals[i + 3 * e]) + _sq(vals[i + 7 * e])
        buf[i] = (a0 + a2) + (a1 + a3)
    for i in range(full, e):
        a0 = _sq(vals[i]) + _sq_at(vals, i + 4 * e, n)
        a1 = _sq(vals[i + e]) + _sq_at(vals, i + 5 * e, n)
        a2 = _sq(vals[i + 2 * e]) + _sq_at(vals, i + 6 * e, n)
        a3 = _sq(vals[i + 3 * e]) + _sq_at(vals, i + 7 * e, n)
        buf[i] = (a0 + a2) + (a1 + a3)
    h = e
    while h > 1:
        q = h // 2
        for i in range(q):
            buf[i] += buf[i + q]
        h = q
    return buf[0]


@numba.njit(inline="always", cache=True, fastmath=False)
def _key(e):
    """|e| as float32 bits: orders like |e| (NaN above every number)."""
    return np.uint32(np.float32(e).view(np.uint32) & np.uint32(0x7FFFFFFF))


@numba.njit(inline="always", cache=True, fastmath=False)
def _key_at(es, i, n):
    return _key(es[i]) if i < n else np.uint32(0)


@numba.njit(inline="always", cache=True, fastmath=False)
def chunk_span(c, lay, n):
    """[start, end) of chunk c of a tensor of n elements."""
    k, nck, unit = lay[0], lay[1], lay[2]
    if nck == 1:
        a = c * unit
        return a, min(a + unit, n)
    r = c // nck
    a = r * k + (c - r * nck) * CHUNK
    return a, min(a + CHUNK, r * k + k)


@numba.njit(cache=True, fastmath=False)
def chunk_sums(xs, es, n, buf, c, parts):
    """Chunk c: parts[0][c] = sum x^2 of the n values xs (input words), parts[1][c] = sum e^2 of
    their errors es, as fold_squares takes them, in one pass over both; returns max |e| as a
    key. buf holds at least CHUNK // 4 float64."""
    p = 1
    while p < n:
        p *= 2
    if p < 8:
        parts[0][c] = fold_squares(xs, n, buf)
        parts[1][c] = fold_squares(es, n, buf)
        km = np.uint32(0)
        for i in range(n):
            km = max(km, _key(es[i]))
        return np.int32(km)
    e = p // 8
    bx, be = buf[:e], buf[e : 2 * e]
    km = np.uint32(0)
    full = min(e, max(0, n - 7 * e))  # all eight values present (v[i + 3e] always is: n > 4e)
    for i in range(full):
        a0 = _sq(xs[i]) + _sq(xs[i + 4 * e])
        a1 = _sq(xs[i + e]) + _sq(xs[i + 5 * e])
        a2 = _sq(xs[i + 2 * e]) + _sq(xs[i + 6 * e])
        a3 = _sq(xs[i + 3 * e]) + _sq(xs[i + 7 * e])
        bx[i] = (a0 + a2) + (a1 + a3)
        b0 = _sq(es[i]) + _sq(es[i + 4 * e])
        b1 = _sq(es[i + e]) + _sq(es[i + 5 * e])
        b2 = _sq(es[i + 2 * e]) + _sq(es[i + 6 * e])
        b3 = _sq(es[i + 3 * e]) + _sq(es[i + 7 * e])
        be[i] = (b0 + b2) + (b1 + b3)
        k0 = max(max(_key(es[i]), _key(es[i + 4 * e])), max(_key(es[i + e]), _key(es[i + 5 * e])))
        k1 = max(max(_key(es[i + 2 * e]), _key(es[i + 6 * e])),
                 max(_key(es[i + 3 * e]), _key(es[i + 7 * e])))  # fmt: skip
        km = max(km, max(k0, k1))
    for i in range(full, e):
        a0 = _sq(xs[i]) + _sq_at(xs, i + 4 * e, n)
        a1 = _sq(xs[i + e]) + _sq_at(xs, i + 5 * e, n)
        a2 = _sq(xs[i + 2 * e]) + _sq_at(xs, i + 6 * e, n)
        a3 = _sq(xs[i + 3 * e]) + _sq_at(xs, i + 7 * e, n)
        bx[i] = (a0 + a2) + (a1 + a3)
        b0 = _sq(es[i]) + _sq_at(es, i + 4 * e, n)
        b1 = _sq(es[i + e]) + _sq_at(es, i + 5 * e, n)
        b2 = _sq(es[i + 2 * e]) + _sq_at(es, i + 6 * e, n)
        b3 = _sq(es[i + 3 * e]) + _sq_at(es, i + 7 * e, n)
        be[i] = (b0 + b2) + (b1 + b3)
        for t in range(8):
            km = max(km, _key_at(es, i + t * e, n))
    h = e
    while h > 1:
        q = h // 2
        for i in range(q):
            bx[i] += bx[i + q]
            be[i] += be[i + q]
        h = q
    parts[0][c] = bx[0]
    parts[1][c] = be[0]
    return np.int32(km)


def key_value(kmax: np.ndarray) -> float:
    """The largest |e| of per-thread keys (int32) as a Python float."""
    return float(np.int32(kmax.max(initial=0)).view(np.float32))
