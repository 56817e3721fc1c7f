"""ggml's C arithmetic, emulated with torch ops that round exactly as the C does, on any device.

Every helper is one IEEE float32 operation per element (torch never fuses separate kernels into
an FMA) except where it says otherwise. Two torch behaviours are avoided on purpose: a CUDA
tensor divided by a Python number is multiplied by the reciprocal (so divisors are tensors),
and casting NaN/Inf/out-of-range floats to int differs between CPU and CUDA (so the x86
result is computed explicitly).
"""

from __future__ import annotations

import torch

_MAGIC = 12582912.0  # 1.5 * 2**23: adding it leaves round-half-even(x) in the low mantissa bits
_INT_MIN = -(2**31)


def const(value: float, like: torch.Tensor) -> torch.Tensor:
    """A float32 scalar tensor on `like`'s device (a divisor that is never a CPU scalar)."""
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def div(a: torch.Tensor | float, b: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """a / b as a true float32 division on every device (C's `a / b`)."""
    ta = a if isinstance(a, torch.Tensor) else const(a, like)
    tb = b if isinstance(b, torch.Tensor) else const(b, like)
    return torch.div(ta, tb)


def nearest_int(f: torch.Tensor) -> torch.Tensor:
    """ggml's nearest_int: int32 round-half-even of float32 `f` by the 1.5*2**23 trick.

    Past |f| > 4194303 (where ggml asserts in debug builds only) the result is what the trick
    gives, as in release builds; NaN gives 0, as x86's default NaN (mantissa 0x400000) does.
    torch's NaNs are not always that one: CUDA's canonical NaN and the float32 of an fp16 NaN
    (0x7FFFFFFF on CPU, where ggml's conversion gives 0xFFC00000) are not."""
    bits = (f + _MAGIC).view(torch.int32)
    out = (bits & 0x007FFFFF) - 0x00400000
    return torch.where(torch.isnan(f), 0, out)


def sqrtf(f: torch.Tensor) -> torch.Tensor:
    """C's sqrtf, correctly rounded, for f >= 0. torch.sqrt on CPU is not (it can be 1 ulp off
    through MKL): the float64 root is rounded to float32, then moved to the neighbour whose
    rounding interval holds f, tested exactly (squares of 25-bit midpoints fit in float64)."""
    r = torch.sqrt(f.to(torch.float64)).to(torch.float32)
    f64 = f.to(torch.float64)
    down = torch.nextafter(r, torch.zeros_like(r))
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    low = (r.to(torch.float64) + down.to(torch.float64)) / 2  # exact: 25 significant bits
    high = (r.to(torch.float64) + up.to(torch.float64)) / 2
    r = torch.where((r > 0) & (f64 < low * low), down, r)
    return torch.where(torch.isfinite(r) & (f64 > high * high), up, r)


def c_trunc(f: torch.Tensor) -> torch.Tensor:
    """C's (int)f on x86 (cvttss2si): int32 toward zero; NaN, Inf and |f| >= 2**31 give
    INT_MIN (whose low byte, 0, is what a cast to uint8/int8 keeps)."""
    t = torch.trunc(f)
    valid = t.abs() < 2.0**31  # False for NaN and Inf too
    return torch.where(valid, t, 0.0).to(torch.int32).masked_fill(~valid, _INT_MIN)


def c_roundf(f: torch.Tensor) -> torch.Tensor:
    """C's roundf (half away from zero), exactly: floor(a) + floor(2 (a - floor(a))) with the
    sign of f, as gguf-py's np_roundf (a + 0.5 would round up 0.49999997)."""
    a = f.abs()
    floored = torch.floor(a)
    return torch.sign(f) * (floored + torch.floor(2 * (a - floored)))


def low_byte(i: torch.Tensor) -> torch.Tensor:
    """The low 8 bits of an integer tensor, as C's conversion to uint8_t/int8_t keeps them."""
    return (i & 0xFF).to(torch.uint8)


def fp16_bytes(f: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8: the little-endian fp16 of float32 `f`, rounded to nearest even
    (GGML_FP32_TO_FP16; overflow to Inf as ggml's software conversion)."""
    return f.to(torch.float16).unsqueeze(-1).view(torch.uint8)


def fp16_value(f: torch.Tensor) -> torch.Tensor:
    """float32 of the fp16 that `f` is stored as (GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(f)))."""
    return f.to(torch.float16).to(torch.float32)


def read_fp16(b: torch.Tensor) -> torch.Tensor:
    """(...,) float32 from (..., 2) uint8 little-endian fp16 bytes."""
    return b.contiguous().view(torch.float16).squeeze(-1).to(torch.float32)


def seqsum(terms: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """sum over dim 0 in C loop order: ((start + t[0]) + t[1]) + ...; start defaults to +0.0
    (C's `float s = 0; for (...) s += t;`: +0.0 + -0.0 is +0.0, so the start matters)."""
    acc = torch.zeros_like(terms[0]) if start is None else start.clone()
    for t in terms:
        acc.add_(t)
    return acc


def first_greater(values: torch.Tensor, dim: int) -> torch.Tensor:
    """max(0, values...) along `dim` as C's `m = 0; if (v > m) m = v;` scan: +0.0 when nothing
    is positive, and NaN never taken (torch.amax would propagate it)."""
    m = torch.zeros_like(values.select(dim, 0))
    for v in values.unbind(dim):
        m = torch.where(v > m, v, m)
    return m


def pack_nibbles(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """(lo & 15) | (hi & 15) << 4 as uint8: bit 4 of a 5-bit code goes elsewhere."""
    return (lo.to(torch.uint8) & 0x0F) | ((hi.to(torch.uint8) & 0x0F) << 4)
