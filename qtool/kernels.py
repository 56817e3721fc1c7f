"""Quantization kernels: plain, device-agnostic torch. No files, no printing.

Semantics (README "Numerical semantics"): statistics and qparams in float32; the range of every
group includes 0.0; q = clamp(round(x / scale) + zero_point, qmin, qmax) with a float32
division and round-half-to-even; x_hat = (q - zero_point) * scale in float32.

A tensor is viewed as (pre, C, post) where C is the quantization axis (C = 1 per tensor), so
scale and zero_point have shape (C,) per channel and () per tensor. Big tensors are processed
in contiguous slabs of about `block_elems` elements: every elementwise step runs in place on a
cache-sized float32 buffer, so a tensor crosses memory once (per channel, axis 0) or twice (per
tensor: one pass for its range, one to quantize) and no full-size float temporary exists.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from qtool.metrics import ErrorAccumulator
from qtool.spec import QSpec, Scheme, StorageDtype
from qtool.summary import ErrorStats

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TORCH_STORAGE = {StorageDtype.INT8: torch.int8, StorageDtype.UINT8: torch.uint8}
SMALLEST_NORMAL = torch.finfo(torch.float32).tiny
DEFAULT_BLOCK_ELEMS = 1 << 21  # 8 MiB of float32: stays in L3 and amortises per-op overhead

Box = tuple[int, int, int, int, int, int]  # (i0, i1, c0, c1, p0, p1) in the (pre, C, post) view


class NonFiniteInput(ValueError):
    """The tensor holds NaN or +-Inf, which have no integer code (count None: not yet counted)."""

    def __init__(self, count: int | None = None) -> None:
        super().__init__(f"{count} NaN/Inf value(s)")
        self.count = count


@dataclass(frozen=True)
class QuantizedTensor:
    """Codes in the storage dtype (original shape) with their qparams and error figures."""

    q: torch.Tensor
    scale: torch.Tensor  # float32, (C,) or ()
    zero_point: torch.Tensor  # storage dtype, same shape as scale
    errors: ErrorStats | None


def normalize_axis(axis: int | None, ndim: int) -> int | None:
    """Map a possibly negative axis into [0, ndim); ValueError when out of range."""
    if axis is None:
        return None
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a {ndim}-D tensor")
    return axis % ndim


def group_shape(shape: tuple[int, ...], axis: int | None) -> tuple[int, int, int]:
    """(pre, C, post): the tensor seen as C groups of pre*post elements each."""
    if axis is None:
        return (1, 1, math.prod(shape))
    return (math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :]))


def qparams_from_range(
    lo: torch.Tensor, hi: torch.Tensor, spec: QSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (scale, zero_point) for groups whose minima are `lo` and maxima `hi`.

    zero_point is returned as float32 holding an integer (cast by the caller for storage).
    Runs once per slab, so it is kept to a handful of small in-place ops.
    """
    lo, hi = lo.float(), hi.float()
    if spec.scheme is Scheme.SYM:
        span = torch.maximum(hi, lo.neg()).clamp_(min=0.0)  # amax over a range holding 0
        scale = span / ((spec.qmax - spec.qmin) / 2)  # amax / 127
    else:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
        span = hi - lo
        scale = span / (spec.qmax - spec.qmin)  # (hi - lo) / 255
    if not math.isfinite(float(scale.amax())):  # amax propagates NaN; cheaper than isfinite().all()
        if not bool(torch.isfinite(lo).all() and torch.isfinite(hi).all()):
            raise NonFiniteInput()  # NaN propagates through amin/amax; Inf lands in them
        raise ValueError("value range overflows float32; use --scheme sym for such tensors")
    # An all-zero group gets scale 1.0; no scale is ever 0 or subnormal (x / scale stays finite).
    scale.clamp_(min=SMALLEST_NORMAL).masked_fill_(span == 0, 1.0)
    if spec.scheme is Scheme.SYM:
        zero_point = torch.full_like(scale, spec.symmetric_zero_point)
    else:
        zero_point = (spec.qmin - torch.round(lo / scale)).clamp_(spec.qmin, spec.qmax)
    _check_grid_finite(scale, zero_point, spec)
    return scale, zero_point


def _check_grid_finite(scale: torch.Tensor, zero_point: torch.Tensor, spec: QSpec) -> None:
    """Refuse qparams whose extreme codes dequantize to +-inf: amax / 127 * 127 can round
    above float32's largest value (a causal mask filled with finfo(float32).min does)."""
    reach = torch.maximum((spec.qmax - zero_point).abs(), (spec.qmin - zero_point).abs())
    if not math.isfinite(float((reach * scale).amax())):
        raise ValueError(
            "values reach the float32 limit (about 3.4e38, e.g. a mask filled with "
            "finfo(float32).min): their reconstruction would overflow to infinity; "
            "--exclude this tensor to keep it as it is"
        )


def channel_range(x: torch.Tensor, spec: QSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (min, max) in x's dtype: shape (C,) or (). One pass, no temporaries."""
    axis = normalize_axis(spec.axis, x.ndim)
    if x.numel() == 0:
        raise ValueError("cannot quantize an empty tensor")
    if axis is None:
        return torch.aminmax(x)  # full reductions: aminmax is one pass and ~1.7x faster
    x3 = x.reshape(group_shape(tuple(x.shape), axis))
    return x3.amin(dim=(0, 2)), x3.amax(dim=(0, 2))


def compute_qparams(x: torch.Tensor, spec: QSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 scale and storage-dtype zero_point of every group of x."""
    _check_float(x)
    lo, hi = channel_range(x, spec)
    with _counting_nonfinite(x):
        scale, zero_point = qparams_from_range(lo, hi, spec)
    return scale, zero_point.to(TORCH_STORAGE[spec.dtype])


def quantize(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QSpec
) -> torch.Tensor:
    """clamp(round(x / scale) + zero_point, qmin, qmax) in the storage dtype, x's shape."""
    _check_float(x)
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=TORCH_STORAGE[spec.dtype], device=x.device)
    ws = Workspace(x.device)
    zp = zero_point.float()
    _quantize_slabs(x, scale.float(), zp, spec, q, None, DEFAULT_BLOCK_ELEMS, ws, own_qparams=False)
    return q


def quantize_tensor(
    x: torch.Tensor,
    spec: QSpec,
    *,
    with_errors: bool = True,
    block_elems: int = DEFAULT_BLOCK_ELEMS,
    workspace: Workspace | None = None,
) -> QuantizedTensor:
    """Compute qparams, quantize, and (optionally) measure the error, in as few passes as can be.

    With a `workspace`, the codes live in its reused memory: consume them (write them out)
    before the next call with the same workspace.
    """
    _check_float(x)
    x = x.contiguous()
    axis = normalize_axis(spec.axis, x.ndim)
    pre, channels, post = group_shape(tuple(x.shape), axis)
    ws = workspace or Workspace(x.device)
    q = ws.codes(tuple(x.shape), TORCH_STORAGE[spec.dtype])
    acc = ErrorAccumulator() if with_errors else None
    with _counting_nonfinite(x):
        if pre == 1 and channels > 1 and 0 < post <= block_elems:
            x2 = x.view(channels, post)
            scale, zero_point = _quantize_rows(x2, spec, q, acc, block_elems, ws)
        else:
            lo, hi = channel_range(x, spec)
            scale, zero_point = qparams_from_range(lo, hi, spec)
            _quantize_slabs(x, scale, zero_point, spec, q, acc, block_elems, ws)
    return QuantizedTensor(
        q=q,
        scale=scale,
        zero_point=zero_point.to(q.dtype),
        errors=acc.result() if acc is not None else None,
    )


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    axis: int | None,
    dtype: torch.dtype = torch.float32,
    block_elems: int = DEFAULT_BLOCK_ELEMS,
) -> torch.Tensor:
    """(q - zero_point) * scale in float32, stored as `dtype`; axis None means per tensor."""
    if q.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"codes must be int8 or uint8, got {q.dtype}")
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    shape = group_shape(tuple(q.shape), normalize_axis(axis, q.ndim))
    q3, out3 = q.view(shape), out.view(shape)
    scale3, zp3 = scale.float().reshape(1, -1, 1), zero_point.float().reshape(1, -1, 1)
    buf = torch.empty(min(q.numel(), block_elems), dtype=torch.float32, device=q.device)
    for box in _slabs(shape, block_elems):
        i0, i1, c0, c1, p0, p1 = box
        src = q3[i0:i1, c0:c1, p0:p1]
        b = buf[: src.numel()].view(src.shape)
        torch.sub(src, zp3[:, c0:c1], out=b)
        b.mul_(scale3[:, c0:c1])
        out3[i0:i1, c0:c1, p0:p1].copy_(b)
    return out


def _quantize_rows(
    x2: torch.Tensor,
    spec: QSpec,
    q: torch.Tensor,
    acc: ErrorAccumulator | None,
    block_elems: int,
    ws: Workspace,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, each channel one contiguous row of x2 (C, post): range and codes from the
    same cache-resident slab, so the tensor crosses memory once."""
    channels, post = x2.shape
    q2 = q.view(channels, post)
    rows = max(1, block_elems // post)
    scale = torch.empty(channels, dtype=torch.float32, device=x2.device)
    zero_point = torch.empty_like(scale)
    bufs = ws.scratch(min(rows, channels) * post, x2.dtype)
    for r0 in range(0, channels, rows):
        xf, work = bufs.take(x2[r0 : r0 + rows])  # upcast first: f32 reductions run ~2x faster
        lo, hi = xf.amin(dim=1), xf.amax(dim=1)  # (aminmax with dim= is ~10x slower)
        s, z = qparams_from_range(lo, hi, spec)
        scale[r0 : r0 + rows], zero_point[r0 : r0 + rows] = s, z
        _quantize_block(xf, work, s[:, None], z[:, None], spec, q2[r0 : r0 + rows], acc)
    return scale, zero_point


def _quantize_slabs(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    spec: QSpec,
    q: torch.Tensor,
    acc: ErrorAccumulator | None,
    block_elems: int,
    ws: Workspace,
    own_qparams: bool = True,
) -> None:
    """Quantize x slab by slab with qparams already known for every group (`own_qparams`:
    they were derived from x itself, so every value lies inside the range)."""
    shape = group_shape(tuple(x.shape), normalize_axis(spec.axis, x.ndim))
    x3, q3 = x.view(shape), q.view(shape)
    scale3, zp3 = scale.reshape(1, -1, 1), zero_point.reshape(1, -1, 1)
    bufs = ws.scratch(min(x.numel(), block_elems), x.dtype)
    for i0, i1, c0, c1, p0, p1 in _slabs(shape, block_elems):
        xf, work = bufs.take(x3[i0:i1, c0:c1, p0:p1])
        q_slab = q3[i0:i1, c0:c1, p0:p1]
        _quantize_block(xf, work, scale3[:, c0:c1], zp3[:, c0:c1], spec, q_slab, acc, own_qparams)


class Workspace:
    """Memory reused across slabs and tensors: a fresh allocation costs page faults on first
    touch, which for a cache-sized slab cost as much as the arithmetic itself."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._codes = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._floats = torch.empty(0, dtype=torch.float32, device=self.device)

    def codes(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-byte tensor of `shape`, valid until the next call."""
        numel = math.prod(shape)
        if self._codes.numel() < numel:
            self._codes = torch.empty(numel, dtype=torch.uint8, device=self.device)
        return self._codes[:numel].view(dtype).view(shape)

    def scratch(self, numel: int, dtype: torch.dtype) -> _Buffers:
        # Non-float32 inputs are upcast once per slab into a second buffer (exact for f16/bf16).
        need = numel * (1 if dtype == torch.float32 else 2)
        if self._floats.numel() < need:
            self._floats = torch.empty(need, dtype=torch.float32, device=self.device)
        return _Buffers(self._floats[:numel], self._floats[numel:need])


class _Buffers:
    """Float32 scratch for one slab: `work` always, `upcast` for non-float32 inputs."""

    def __init__(self, work: torch.Tensor, upcast: torch.Tensor) -> None:
        self.work = work
        self.upcast = upcast

    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = like.numel()
        work = self.work[:n].view(like.shape)
        if like.dtype == torch.float32:
            return like, work
        xf = self.upcast[:n].view(like.shape)
        xf.copy_(like)
        return xf, work


def _quantize_block(
    xf: torch.Tensor,
    work: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    spec: QSpec,
    q_out: torch.Tensor,
    acc: ErrorAccumulator | None,
    own_qparams: bool = True,
) -> None:
    """One cache-resident slab (xf: float32 values, work: scratch of its shape): codes into
    q_out, error sums into acc. Every step runs in place."""
    # uint8 codes are built as int8 values q - 128 whose top bit is then flipped (q - 128 + 256
    # mod 256 = q): torch's float->uint8 cast runs ~3x slower than float->int8 on CPU.
    shift = 128 if spec.dtype is StorageDtype.UINT8 else 0
    torch.div(xf, scale, out=work)  # a division, not * (1/scale): bit-identical on CPU and CUDA
    work.round_()  # half to even
    general = spec.scheme is Scheme.ASYM or not own_qparams
    if general:
        work.add_(zero_point - shift).clamp_(spec.qmin - shift, spec.qmax - shift)
    # Symmetric with its own qparams: |x| <= amax, so |x / scale| <= 127 (1 + 2^-23) and no
    # clamp is needed; the rounded value already is q - zero_point = q - shift.
    q_out.view(torch.int8).copy_(work)
    if shift:
        q_out.view(torch.uint8).bitwise_xor_(0x80)
    if acc is None:
        return
    if general:
        work.sub_(zero_point - shift)  # q - zero_point, exact in float32
    torch.addcmul(xf, work, scale, value=-1.0, out=work)  # error = x - (q - zp) * scale
    acc.add(xf, work)


def _slabs(shape: tuple[int, int, int], block_elems: int) -> Iterator[Box]:
    """Contiguous boxes of about block_elems elements covering (pre, C, post) in memory order."""
    pre, channels, post = shape
    if channels * post <= block_elems:
        step = max(1, block_elems // max(1, channels * post))
        for i in range(0, pre, step):
            yield (i, min(i + step, pre), 0, channels, 0, post)
    elif post <= block_elems:
        step = block_elems // post
        for i in range(pre):
            for c in range(0, channels, step):
                yield (i, i + 1, c, min(c + step, channels), 0, post)
    else:
        for i in range(pre):
            for c in range(channels):
                for p in range(0, post, block_elems):
                    yield (i, i + 1, c, c + 1, p, min(p + block_elems, post))


def _check_float(x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"can only quantize float16/bfloat16/float32/float64, got {x.dtype}")


@contextmanager
def _counting_nonfinite(x: torch.Tensor) -> Iterator[None]:
    """Give a NonFiniteInput raised while processing x its count (one extra pass, on failure)."""
    try:
        yield
    except NonFiniteInput as err:
        if err.count is not None:
            raise
        raise NonFiniteInput(int((~torch.isfinite(x)).sum())) from None
