"""Scalar helpers of the fused CPU kernels (numba): an input element's float32 value from its
storage word, float32 rounded to bf16/fp16 words (round half to even) and back, and the integer
keys min/max run on. All compiled with fastmath off: they give torch's bits whatever the CPU.

Importing this module imports numba; numerics/select.py decides whether that happens.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload


def to_f32(v):
    """The float32 value of one input element (specialised on its numba type)."""
    raise NotImplementedError  # only called from jitted code


@overload(to_f32, jit_options={"fastmath": False})
def to_f32_impl(v):
    if v == types.float32:
        return lambda v: v
    if v == types.float64:
        return lambda v: np.float32(v)  # round to nearest even, as torch's .float()
    if v == types.uint16:  # bf16: the top half of a float32
        return lambda v: np.uint32(np.uint32(v) << 16).view(np.float32)
    if v == types.int16:  # fp16 words
        return lambda v: half_to_f32(v)
    return None


@numba.njit(inline="always", cache=True, fastmath=False)
def half_to_f32(v):
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
def key(f):
    """int32 that orders like the float32 f (-0.0 just below +0.0)."""
    b = np.float32(f).view(np.int32)
    return np.int32(b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF)))


@numba.njit(inline="always", cache=True, fastmath=False)
def unkey(k):
    return np.int32(k ^ ((k >> np.int32(31)) & np.int32(0x7FFFFFFF))).view(np.float32)


@numba.njit(inline="always", cache=True, fastmath=False)
def f32_to_half(f):
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
def f32_to_bf16(f):
    """fp32 -> bf16 word, round to nearest even (finite inputs)."""
    b = np.int64(np.float32(f).view(np.uint32))
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16


@numba.njit(inline="always", cache=True, fastmath=False)
def _bf16_rounded(f):
    """f rounded to bf16 (half to even), as float32."""
    b = np.float32(f).view(np.uint32)
    r = np.uint32(b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
    return np.uint32(r & np.uint32(0xFFFF0000)).view(np.float32)


def restore(f, w):
    """x_hat (float32) as the tensor of w's storage type restores it: rounded to bf16 for bf16
    words, to fp16 for fp16 words (overflow to Inf, as torch), kept for float32/float64."""
    raise NotImplementedError  # only called from jitted code


@overload(restore, jit_options={"fastmath": False})
def restore_impl(f, w):
    if w == types.uint16:  # f32_to_bf16 in 32-bit lanes (a finite x_hat cannot carry out)
        return lambda f, w: _bf16_rounded(f)
    if w == types.int16:
        return lambda f, w: half_to_f32(np.int16(np.uint16(f32_to_half(f))))
    if w in (types.float32, types.float64):
        return lambda f, w: f
    return None
