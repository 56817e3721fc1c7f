"""numba bodies of the fused GGUF block kernels (entry points and choice: numerics/gguf/fast.py).

A line-by-line transcription of ggml-quants.c's quantize_row_*_ref and dequantize_row_*, one
block at a time, compiled with fastmath off: every float32 operation is one IEEE operation in
the C's order (no contraction into FMAs, no reassociation, no reciprocal), so the bytes are the
C's on an x86-64 release build, as the torch kernels' are. Integer conversions are spelt out as
x86 performs them (cvttss2si: INT_MIN for NaN, Inf and out-of-range values; a conversion to a
char keeps the low byte). Constants are float32 on purpose: numba, like numpy, widens
float32 op float64 to float64.

Quantize kernels take (n, block_size) float32 and fill (n, type_size) uint8; dequantize
kernels the reverse. Blocks run in parallel (prange) in runs of CHUNK, each with its own
scratch arrays.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

CHUNK = 64  # blocks per parallel task: scratch arrays are allocated once per run

_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23
_INT_MIN = -(2**31)
_TWO31 = np.float32(2.0**31)
_TO_INF = np.float32(2.0**112)
_TO_ZERO = np.float32(2.0**-110)
_EPS = np.float32(1e-15)  # GROUP_MAX_EPS
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_FLT_MAX = np.float32(np.finfo(np.float32).max)


# ---------------------------------------------------------------- C arithmetic


@numba.njit(cache=True, fastmath=False, inline="always")
def nearest_int(f):
    """ggml's nearest_int: the low mantissa bits of f + 1.5 * 2**23, less 2**22."""
    i = np.int64(np.float32(f + _MAGIC).view(np.int32))
    return (i & 0x007FFFFF) - 0x00400000


@numba.njit(cache=True, fastmath=False, inline="always")
def c_int(f):
    """C's (int)f on x86-64: toward zero, INT_MIN for NaN, Inf and |f| >= 2**31."""
    if not (abs(f) < _TWO31):
        return _INT_MIN
    return np.int64(f)


@numba.njit(cache=True, fastmath=False, inline="always")
def as_int8(i):
    """The int8_t a C conversion keeps of int i (its low byte, signed)."""
    b = i & 0xFF
    return b - 256 if b >= 128 else b


@numba.njit(cache=True, fastmath=False, inline="always")
def roundf(f):
    """C's roundf (half away from zero) exactly: floor(a) + floor(2 (a - floor(a)))."""
    a = abs(f)
    fl = np.float32(np.floor(a))
    r = np.float32(fl + np.float32(np.floor(np.float32(np.float32(2.0) * np.float32(a - fl)))))
    return -r if f < _F0 else r


@numba.njit(cache=True, fastmath=False, inline="always")
def fp16_bits(f):
    """ggml_compute_fp32_to_fp16: the fp16 word of float32 f (round to nearest even)."""
    base = np.float32(np.float32(abs(f) * _TO_INF) * _TO_ZERO)
    w = np.int64(np.float32(f).view(np.uint32))
    shl1_w = (w + w) & 0xFFFFFFFF
    sign = w & 0x80000000
    bias = max(shl1_w & 0xFF000000, 0x71000000)
    base = np.float32(np.uint32((bias >> 1) + 0x07800000).view(np.float32) + base)
    bits = np.int64(base.view(np.uint32))
    nonsign = ((bits >> 13) & 0x7C00) + (bits & 0x0FFF)
    return (sign >> 16) | (0x7E00 if shl1_w > 0xFF000000 else nonsign)


@numba.njit(cache=True, fastmath=False, inline="always")
def fp16_value(h):
    """The float32 value of fp16 word h (exact; NaN payloads kept as ggml's shift keeps them)."""
    h = np.int64(h) & 0xFFFF
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    if exp == 0:
        v = np.float32(np.float32(mant) * np.float32(2.0**-24))  # exact
        return -v if sign else v
    if exp == 31:
        return np.uint32(sign | 0x7F800000 | (mant << 13)).view(np.float32)
    return np.uint32(sign | ((exp + 112) << 23) | (mant << 13)).view(np.float32)


@numba.njit(cache=True, fastmath=False, inline="always")
def put_fp16(out, pos, f):
    h = fp16_bits(f)
    out[pos] = h & 0xFF
    out[pos + 1] = h >> 8


@numba.njit(cache=True, fastmath=False, inline="always")
def get_fp16(raw, pos):
    return fp16_value(np.int64(raw[pos]) | (np.int64(raw[pos + 1]) << 8))


@numba.njit(cache=True, fastmath=False, inline="always")
def inverse(d):
    """C's `d ? 1.0f/d : 0.0f` (NaN is true)."""
    return np.float32(_F1 / d) if d != _F0 else _F0


# ---------------------------------------------------------------- legacy quantize


@numba.njit(cache=True, fastmath=False, inline="always")
def _pack(out, at, xi0, xi1, five_bits):
    """Q4_*: `qs = xi0; qs |= xi1 << 4`; Q5_*: `(xi0 & 0x0F) | ((xi1 & 0x0F) << 4)`."""
    if five_bits:
        out[at] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4)
    else:
        out[at] = (xi0 | (xi1 << 4)) & 0xFF


@numba.njit(cache=True, fastmath=False, inline="always")
def _q_abs(x, nmax, half, out, qs_at, qh_at):
    """quantize_row_q4_0_ref (nmax 8) / q5_0 (nmax 16) on one block of 32."""
    amax = _F0
    top = _F0
    for j in range(32):
        v = x[j]
        if amax < abs(v):
            amax = abs(v)
            top = v
    d = np.float32(top / np.float32(-nmax))
    i_d = inverse(d)
    put_fp16(out, 0, d)
    qmax = 2 * nmax - 1
    qh = 0
    for j in range(16):
        x0 = np.float32(x[j] * i_d)
        x1 = np.float32(x[j + 16] * i_d)
        xi0 = min(qmax, as_int8(c_int(np.float32(x0 + half)))) & 0xFF
        xi1 = min(qmax, as_int8(c_int(np.float32(x1 + half)))) & 0xFF
        _pack(out, qs_at + j, xi0, xi1, qh_at)
        qh |= ((xi0 & 0x10) >> 4) << j
        qh |= ((xi1 & 0x10) >> 4) << (j + 16)
    if qh_at:
        for b in range(4):
            out[qh_at + b] = (qh >> (8 * b)) & 0xFF


@numba.njit(cache=True, fastmath=False, inline="always")
def _q_min(x, nbits, out, qs_at, qh_at):
    """quantize_row_q4_1_ref (nbits 4) / q5_1 (nbits 5) on one block of 32."""
    lo = _FLT_MAX
    hi = -_FLT_MAX
    for j in range(32):
        v = x[j]
        if v < lo:
            lo = v
        if v > hi:
            hi = v
    d = np.float32(np.float32(hi - lo) / np.float32((1 << nbits) - 1))
    i_d = inverse(d)
    put_fp16(out, 0, d)
    put_fp16(out, 2, lo)
    half = np.float32(0.5)
    qh = 0
    for j in range(16):
        x0 = np.float32(np.float32(x[j] - lo) * i_d)
        x1 = np.float32(np.float32(x[j + 16] - lo) * i_d)
        if nbits == 4:  # MIN(15, (int8_t)(x0 + 0.5f))
            xi0 = min(15, as_int8(c_int(np.float32(x0 + half)))) & 0xFF
            xi1 = min(15, as_int8(c_int(np.float32(x1 + half)))) & 0xFF
        else:  # (uint8_t)(x0 + 0.5f)
            xi0 = c_int(np.float32(x0 + half)) & 0xFF
            xi1 = c_int(np.float32(x1 + half)) & 0xFF
        _pack(out, qs_at + j, xi0, xi1, qh_at)
        qh |= ((xi0 & 0x10) >> 4) << j
        qh |= ((xi1 & 0x10) >> 4) << (j + 16)
    if qh_at:
        for b in range(4):
            out[qh_at + b] = (qh >> (8 * b)) & 0xFF


@numba.njit(cache=True, fastmath=False, inline="always")
def _q8_0(x, out):
    amax = _F0
    for j in range(32):
        a = abs(x[j])
        amax = amax if amax > a else a  # MAX(amax, fabsf(v))
    d = np.float32(amax / np.float32(127.0))
    i_d = inverse(d)
    put_fp16(out, 0, d)
    for j in range(32):
        out[2 + j] = c_int(roundf(np.float32(x[j] * i_d))) & 0xFF


@numba.njit(cache=True, fastmath=False, parallel=True)
def quantize_legacy(blocks, out, kind):
    """kind: 0 Q4_0, 1 Q4_1, 2 Q5_0, 3 Q5_1, 4 Q8_0."""
    for i in prange(blocks.shape[0]):
        x, o = blocks[i], out[i]
        if kind == 0:
            _q_abs(x, 8, np.float32(8.5), o, 2, 0)
        elif kind == 1:
            _q_min(x, 4, o, 4, 0)
        elif kind == 2:
            _q_abs(x, 16, np.float32(16.5), o, 6, 2)
        elif kind == 3:
            _q_min(x, 5, o, 8, 4)
        else:
            _q8_0(x, o)


# ---------------------------------------------------------------- legacy dequantize


@numba.njit(cache=True, fastmath=False, parallel=True)
def dequantize_legacy(raw, out, kind):
    """kind as quantize_legacy; gguf.quants' floats: d * (q - 8), d * q + m, q * d."""
    for i in prange(raw.shape[0]):
        if kind == 4:
            _deq_q8_0(raw[i], out[i])
        else:
            _deq_q45(raw[i], out[i], kind)


@numba.njit(cache=True, fastmath=False, inline="always")
def _deq_q8_0(b, y):
    d = get_fp16(b, 0)
    for j in range(32):
        q = np.int64(b[2 + j])
        y[j] = np.float32(np.float32(q - 256 if q >= 128 else q) * d)


@numba.njit(cache=True, fastmath=False, inline="always")
def _deq_q45(b, y, kind):
    """Q4_0 (kind 0): d, qs; Q4_1: d, m, qs; Q5_0: d, qh, qs; Q5_1: d, m, qh, qs."""
    d = get_fp16(b, 0)
    m = get_fp16(b, 2) if kind == 1 or kind == 3 else _F0
    qs_at = 2 + 2 * kind
    qh = np.int64(0)
    if kind >= 2:
        at = qs_at - 4
        for k in range(4):
            qh |= np.int64(b[at + k]) << (8 * k)
    for j in range(32):
        q = (np.int64(b[qs_at + j]) & 0x0F) if j < 16 else (np.int64(b[qs_at + j - 16]) >> 4)
        if kind >= 2:
            q |= ((qh >> j) & 1) << 4
        if kind == 0:
            y[j] = np.float32(d * np.float32(np.float32(q) - np.float32(8.0)))
        elif kind == 2:
            y[j] = np.float32(d * np.float32(np.float32(q) - np.float32(16.0)))
        else:
            y[j] = np.float32(np.float32(d * np.float32(q)) + m)


# ---------------------------------------------------------------- error sums

SLAB = 1 << 16  # elements per parallel task of error_sums


@numba.njit(cache=True, fastmath={"reassoc"}, parallel=True)
def error_sums(x, y, out):
    """out[k] = (sum e^2, sum x^2, max |e| as its float32 bits) of slab k of the 1-D float32
    x and y, e = x - y in float32 (metrics.error_stats' definition). Only the float64 adds are
    reassociated; a NaN error has the largest bits, so it wins the max (sticky)."""
    n = x.shape[0]
    for k in prange((n + SLAB - 1) // SLAB):
        se = 0.0
        sx = 0.0
        kmax = np.int32(0)
        for i in range(k * SLAB, min(n, k * SLAB + SLAB)):
            e = np.float32(x[i] - y[i])
            se += np.float64(e) * np.float64(e)
            sx += np.float64(x[i]) * np.float64(x[i])
            kmax = max(kmax, np.int32(e.view(np.int32) & np.int32(0x7FFFFFFF)))
        out[k, 0] = se
        out[k, 1] = sx
        out[k, 2] = np.float64(kmax)
