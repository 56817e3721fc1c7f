"""The canonical error sums of the fused CPU kernels (numba): numerics/metrics.py's definition.

A tensor is cut into chunks (metrics.py: units of whole [C, K] rows, long rows in pieces of CHUNK
elements); the float64 squares of a chunk are summed by folding in halves, and the chunk sums are
written to an array (one slot per chunk) that Python adds exactly (math.fsum). A kernel thread owns
whole chunks, so the sums do not depend on the thread count. Compiled with fastmath off: the fold
is a fixed tree of float64 adds (it vectorises as it is: the adds of a level are independent).

`lay` tuples are (K, chunks per unit, elements per unit, chunks): see `layout` in fused.py.
Importing this module imports numba; numerics/select.py decides whether that happens.
"""

from __future__ import annotations

import numba
import numpy as np

from qtool.numerics.fused_words import to_f32

CHUNK = 4096  # metrics.CHUNK


@numba.njit(cache=True, fastmath=False)
def fold(buf, n):
    """Sum of buf[:n] folded in halves over the next power of two (buf is zero-padded to it)."""
    p = 1
    while p < n:
        p *= 2
    for i in range(n, p):
        buf[i] = 0.0
    while p > 1:
        h = p // 2
        for i in range(h):
            buf[i] += buf[i + h]
        p = h
    return buf[0]


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


@numba.njit(inline="always", cache=True, fastmath=False)
def _abs_key(e):
    """|e| as an int32 that orders like it (max of keys = key of the max; NaN sorts last)."""
    return np.int32(np.float32(e).view(np.int32) & np.int32(0x7FFFFFFF))


@numba.njit(cache=True, fastmath=False)
def chunk_sums(xs, es, n, bufs, c, parts):
    """Chunk c at once (a kernel thread's own): parts[0][c] = sum x^2, parts[1][c] = sum e^2
    of the n values xs (input words) and errors es; returns the largest |e| as a key."""
    kmax = np.int32(0)
    for i in range(n):
        v = np.float64(to_f32(xs[i]))
        e = np.float64(es[i])
        bufs[0, i] = v * v
        bufs[1, i] = e * e
        kmax = max(kmax, _abs_key(es[i]))
    parts[0][c] = fold(bufs[0], n)
    parts[1][c] = fold(bufs[1], n)
    return kmax


@numba.njit(cache=True, fastmath=False)
def push(xs, es, em, n, bufs, cs, parts, with_minmax):
    """Append a run of n (x, e, and with_minmax the min-max error em) to the chunk being filled
    (bufs [3, CHUNK], cs = [fill, chunk index]); a full chunk is flushed. Returns max |e| key."""
    kmax = np.int32(0)
    i = 0
    while i < n:
        f = cs[0]
        take = min(n - i, CHUNK - f)
        for j in range(take):
            v = np.float64(to_f32(xs[i + j]))
            e = np.float64(es[i + j])
            bufs[0, f + j] = v * v
            bufs[1, f + j] = e * e
            kmax = max(kmax, _abs_key(es[i + j]))
        if with_minmax:
            for j in range(take):
                m = np.float64(em[i + j])
                bufs[2, f + j] = m * m
        cs[0] = f + take
        i += take
        if cs[0] == CHUNK:
            flush(bufs, cs, parts, with_minmax)
    return kmax


@numba.njit(cache=True, fastmath=False)
def flush(bufs, cs, parts, with_minmax):
    """The chunk being filled is complete: its sums into its slots, the next chunk begins."""
    n, c = cs[0], cs[1]
    if n == 0:
        return
    parts[0][c] = fold(bufs[0], n)
    parts[1][c] = fold(bufs[1], n)
    if with_minmax:
        parts[2][c] = fold(bufs[2], n)
    cs[0] = 0
    cs[1] = c + 1


def key_value(kmax: np.ndarray) -> float:
    """The largest |e| of per-thread keys (int32) as a Python float."""
    return float(np.int32(kmax.max(initial=0)).view(np.float32))
