"""Quantization kernels: plain, device-agnostic torch. No files, no printing.

Semantics (docs/numerics.md): statistics and qparams in float32; the range of every
group includes 0.0; q = clamp(round(x / scale) + zero_point, qmin, qmax) with a float32
division and round-half-to-even; x_hat = (q - zero_point) * scale in float32.

The granularity decides the view (numerics/views.py). Per group (and per channel on axis 0)
the tensor is the [C, K] matrix of its rows, cut into groups of L consecutive elements (L = K
per channel): rows are processed in cache-sized slabs whose range and codes come from the same
resident data, so the tensor crosses memory once; the range method (numerics/range_methods.py)
turns each slab's values into its qparams. Per tensor, and per channel on another axis, it is
viewed as (pre, C, post) with C the quantization axis (C = 1 per tensor): one pass for the
range, one for the codes. Every elementwise step runs in place on a reused float32 buffer; no
full-size float temporary exists. 4-bit codes are computed unpacked, then packed two per byte.
Error figures (numerics/metrics.py) measure x_hat rounded to x's own dtype, fed to the measure in
the tensor's flat order.

The module also holds the one quantize dispatch (`quantize_with` and its siblings, at the end):
a tensor quantized with any codec, what the quantize loop, its slabs, the batches of tiny
tensors, the plots, the error budget and the calibrated methods call. Each codec family's
kernels are registered by its kind (FAMILIES), imported on first use:

    grid  (spec.QSpec)      the torch kernels above or the fused ones (fused.py), as
                            numerics/select.py chooses (QTOOL_KERNEL); tiny tensors of one spec
                            may be stacked into one call (engine/batch.py)
    gguf  (spec.GGUFSpec)   numerics/gguf/codec.py: llama.cpp's block types (which choose
                            their kernels themselves)

A new codec family writes its Kernels and adds its line to FAMILIES.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from qtool.numerics import select
from qtool.numerics.metrics import Measure
from qtool.numerics.packing import pack_nibbles, unpack_nibbles
from qtool.numerics.range_methods import (
    ColumnWeights,
    MseSearch,
    Qparams,
    RangeMethodImpl,
    qparams_from_range,
    range_method,
)
from qtool.numerics.ranges import NonFiniteInput
from qtool.numerics.slab_errors import Sink, error_of, feed, restored_error
from qtool.numerics.views import (
    channel_range,
    group_parts,
    group_shape,
    normalize_spec,
    part_view,
    row_group_length,
)
from qtool.numerics.workspace import Workspace as Workspace
from qtool.results import ErrorStats
from qtool.spec import (
    Codec,
    PerChannel,
    PerGroup,
    QSpec,
    Scheme,
    StorageDtype,
    matrix_shape,
)

FLOAT_TORCH_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TORCH_STORAGE = {
    StorageDtype.INT8: torch.int8,
    StorageDtype.UINT8: torch.uint8,
    StorageDtype.INT4: torch.int8,  # codes and zero points unpacked, one per byte
    StorageDtype.UINT4: torch.uint8,
}
DEFAULT_BLOCK_ELEMS = 1 << 21  # 8 MiB of float32: stays in L3 and amortises per-op overhead

Box = tuple[int, int, int, int, int, int]  # (i0, i1, c0, c1, p0, p1) in the (pre, C, post) view


@dataclass(frozen=True)
class QuantizedTensor:
    """Codes as stored (4-bit packed two per byte) with their qparams and error figures."""

    q: torch.Tensor
    scale: torch.Tensor  # float32 holding values of the scale dtype, the qparam shape
    zero_point: torch.Tensor  # storage dtype (unpacked), same shape as scale
    errors: ErrorStats | None
    choice: torch.Tensor | None = None  # uint8 candidate index per group (--range mse)
    method: str | None = None  # a calibrated method that chose the codes (None: rounding)


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
    """clamp(round(x / scale) + zero_point, qmin, qmax) as stored (4-bit packed), any qparams."""
    _check_float(x)
    x = x.contiguous()
    spec = normalize_spec(spec, x.ndim)
    codes = torch.empty(x.shape, dtype=TORCH_STORAGE[spec.dtype], device=x.device)
    ws = Workspace(x.device)
    zp = zero_point.float()
    length = row_group_length(spec, tuple(x.shape))
    if length is not None and isinstance(spec.granularity, PerGroup):
        qparams = (scale.float(), zp)
        _quantize_rows(x, length, spec, codes, None, DEFAULT_BLOCK_ELEMS, ws, qparams=qparams)
    else:
        qp = (scale.float(), zp)
        _quantize_slabs(x, qp, spec, codes, None, DEFAULT_BLOCK_ELEMS, ws, own_qparams=False)
    return _stored(codes, zp, spec, ws=None)


def quantize_tensor(
    x: torch.Tensor,
    spec: QSpec,
    *,
    with_errors: bool = True,
    scale_dtype: torch.dtype = torch.float32,
    block_elems: int = DEFAULT_BLOCK_ELEMS,
    workspace: Workspace | None = None,
    weights: ColumnWeights | None = None,
) -> QuantizedTensor:
    """Choose qparams (min-max or the mse search), quantize, and (optionally) measure the
    error, in as few passes as can be. Scales hold values of `scale_dtype` and the codes are
    computed against them. `weights` (an importance matrix's h per input column) make the mse
    search minimise the weighted error; min-max and the error figures do not use them.

    With a `workspace`, the codes live in its reused memory: consume them (write them out)
    before the next call with the same workspace.
    """
    _check_float(x)
    if x.numel() == 0:
        raise ValueError("cannot quantize an empty tensor")
    x = x.contiguous()
    spec = normalize_spec(spec, x.ndim)
    ws = workspace or Workspace(x.device)
    codes = ws.codes(tuple(x.shape), TORCH_STORAGE[spec.dtype])
    ranger = range_method(spec, tuple(x.shape), scale_dtype, block_elems)
    if weights is not None:
        weights.check(tuple(x.shape))
        weights = weights.to(x.device) if ranger.searching else None
    meas = Measure(tuple(x.shape), x.device, minmax=ranger.searching) if with_errors else None
    length = row_group_length(spec, tuple(x.shape))
    with _counting_nonfinite(x):
        # A row longer than a slab is walked in two passes (range, then codes) per channel;
        # a group is always one pass, however long (slabs then hold one group each).
        if length is not None and (isinstance(spec.granularity, PerGroup) or length <= block_elems):
            scale, zero_point, choice = _quantize_rows(
                x, length, spec, codes, meas, block_elems, ws, ranger, weights=weights
            )
        else:
            scale, zero_point, choice = ranger.whole(x, weights)
            minmax = ranger.minmax if isinstance(ranger, MseSearch) and meas else None
            _quantize_slabs(
                x, (scale, zero_point), spec, codes, meas, block_elems, ws, ranger.exact, minmax
            )
    errors = meas.result() if meas is not None else None
    return QuantizedTensor(
        q=_stored(codes, zero_point, spec, ws),
        scale=scale,
        zero_point=zero_point.to(TORCH_STORAGE[spec.dtype]),
        errors=errors,
        choice=choice,
    )


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    spec: QSpec,
    dtype: torch.dtype = torch.float32,
    shape: tuple[int, ...] | None = None,
    block_elems: int = DEFAULT_BLOCK_ELEMS,
) -> torch.Tensor:
    """(q - zero_point) * scale in float32, stored as `dtype`. 4-bit codes are unpacked to
    `shape` (the original shape, which packing cannot tell when the last dimension is odd)."""
    if q.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"codes must be int8 or uint8, got {q.dtype}")
    if spec.dtype.packed:
        shape = shape if shape is not None else (*q.shape[:-1], 2 * q.shape[-1])
        q = unpack_nibbles(q, shape[-1] if shape else 1, spec.dtype.signed).reshape(shape)
    q = q.contiguous()
    spec = normalize_spec(spec, q.ndim)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    length = row_group_length(spec, tuple(q.shape))
    if length is not None and isinstance(spec.granularity, PerGroup):
        _dequantize_rows(q, scale, zero_point, length, out, block_elems)
        return out
    shape3 = group_shape(tuple(q.shape), spec.axis)
    q3, out3 = q.view(shape3), out.view(shape3)
    scale3, zp3 = scale.float().reshape(1, -1, 1), zero_point.float().reshape(1, -1, 1)
    buf = torch.empty(min(q.numel(), block_elems), dtype=torch.float32, device=q.device)
    for box in _slabs(shape3, block_elems):
        i0, i1, c0, c1, p0, p1 = box
        src = q3[i0:i1, c0:c1, p0:p1]
        b = buf[: src.numel()].view(src.shape)
        torch.sub(src, zp3[:, c0:c1], out=b)
        b.mul_(scale3[:, c0:c1])
        out3[i0:i1, c0:c1, p0:p1].copy_(b)
    return out


def _dequantize_rows(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    length: int,
    out: torch.Tensor,
    block_elems: int,
) -> None:
    """dequantize() for groups of `length` along the (C, K) rows, slab by slab."""
    c, k = matrix_shape(tuple(q.shape))
    q2, out2 = q.view(c, k), out.view(c, k)
    s2, z2 = scale.float().reshape(c, -1), zero_point.float().reshape(c, -1)
    buf = torch.empty(
        min(q.numel(), max(block_elems, length)), dtype=torch.float32, device=q.device
    )
    for part, cols in group_parts(k, length):
        q3, out3 = part_view(q2, part, length), part_view(out2, part, length)
        for r0, r1, g0, g1 in _row_slabs(q3.shape, block_elems):
            src = q3[r0:r1, g0:g1]
            b = buf[: src.numel()].view(src.shape)
            torch.sub(src, z2[r0:r1, cols][:, g0:g1, None], out=b)
            b.mul_(s2[r0:r1, cols][:, g0:g1, None])
            out3[r0:r1, g0:g1].copy_(b)


def _stored(
    codes: torch.Tensor, zero_point: torch.Tensor, spec: QSpec, ws: Workspace | None
) -> torch.Tensor:
    """The codes as the file stores them: 8-bit as they are, 4-bit packed two per byte (an odd
    last dimension padded with the code of 0.0, the zero point of each row's last element)."""
    if not spec.dtype.packed:
        return codes
    shape = tuple(codes.shape)
    pad = _last_column_zero_points(zero_point, spec, shape)
    rows = codes.reshape(*shape[:-1], shape[-1]) if shape else codes.reshape(1)
    return pack_nibbles(rows, spec.dtype.signed, pad.reshape(*rows.shape[:-1], 1))


def _last_column_zero_points(
    zero_point: torch.Tensor, spec: QSpec, shape: tuple[int, ...]
) -> torch.Tensor:
    """The zero point of the last element of every row of the last dimension, row-major."""
    zp = zero_point.to(torch.int16).reshape(-1)
    n = shape[-1] if shape else 1
    last = torch.arange(1, math.prod(shape[:-1]) + 1, device=zp.device) * n - 1  # flat indices
    g = spec.granularity
    if isinstance(g, PerGroup):
        _, k = matrix_shape(shape)
        return zp[(last // k) * math.ceil(k / g.size) + (last % k) // g.size]
    if isinstance(g, PerChannel):
        _, channels, post = group_shape(shape, g.axis)
        return zp[(last // post) % channels]
    return zp.expand(last.numel())


def _quantize_rows(
    x: torch.Tensor,
    length: int,
    spec: QSpec,
    codes: torch.Tensor,
    meas: Measure | None,
    block_elems: int,
    ws: Workspace,
    ranger: RangeMethodImpl | None = None,
    qparams: tuple[torch.Tensor, torch.Tensor] | None = None,
    weights: ColumnWeights | None = None,
) -> Qparams:
    """Groups of `length` consecutive elements of the (C, K) rows: each slab's range and codes
    come from the same cache-resident data, so the tensor crosses memory once. Returns scale,
    zero point (float32) and choice in the granularity's shape; with `qparams`, codes only;
    `weights` weigh the range search's errors.
    The errors reach `meas` in flat order: a slab of whole rows whose last group is shorter is
    measured once both of its parts are done."""
    c, k = matrix_shape(tuple(x.shape))
    x2, q2 = x.view(c, k), codes.view(c, k)
    n = math.ceil(k / length)
    scale = torch.empty(c, n, dtype=torch.float32, device=x.device)
    zero_point = torch.empty_like(scale)
    searching = ranger is not None and ranger.searching
    choice = torch.zeros(c, n, dtype=torch.uint8, device=x.device) if searching else None
    if qparams is not None:
        scale.copy_(qparams[0].reshape(c, n))
        zero_point.copy_(qparams[1].reshape(c, n))
    # min-max with float32 scales: no value is clipped
    own = ranger is not None and ranger.exact
    for r0, r1, pieces in _row_walk(c, k, length, block_elems):
        sink = Sink(meas, x2[r0:r1], ws) if len(pieces) > 1 else None
        for part, cols, g0, g1 in pieces:
            x3, q3 = part_view(x2, part, length), part_view(q2, part, length)
            xf, work = ws.take(x3[r0:r1, g0:g1])  # (rows, groups, L)
            s, z = scale[r0:r1, cols][:, g0:g1], zero_point[r0:r1, cols][:, g0:g1]
            if ranger is not None:
                w = None
                if weights is not None:
                    a = part[0] + g0 * part[2]
                    w = weights.block(r0, r1, a, a + (g1 - g0) * part[2])
                    w = w.reshape(w.shape[0], g1 - g0, part[2])
                s_new, z_new, k_new = ranger.groups(xf, w)
                s.copy_(s_new)
                z.copy_(z_new)
                if choice is not None and k_new is not None:
                    choice[r0:r1, cols][:, g0:g1].copy_(k_new)
            where = (part[0], part[1] * part[2])  # the part's columns in the rows
            if meas is not None and isinstance(ranger, MseSearch):
                mm_s, mm_z = ranger.minmax
                error_of(xf, work, mm_s[..., None], mm_z[..., None], spec, ws)
                feed(meas, sink, xf, work, where, minmax=True)
            q_slab = q3[r0:r1, g0:g1]
            _quantize_block(xf, work, s[..., None], z[..., None], spec, q_slab, meas, own, ws)
            if meas is not None:
                feed(meas, sink, xf, work, where, minmax=False)
        if sink is not None:
            sink.flush()
    shape = (c,) if isinstance(spec.granularity, PerChannel) else (c, n)
    reshaped = choice.reshape(shape) if choice is not None else None
    return scale.reshape(shape), zero_point.reshape(shape), reshaped


def _row_slabs(shape: torch.Size, block_elems: int) -> Iterator[tuple[int, int, int, int]]:
    """(r0, r1, g0, g1) boxes of about block_elems elements over a (rows, groups, L) view."""
    rows, groups, length = shape
    per_row = groups * length
    if per_row <= block_elems:
        step = max(1, block_elems // per_row)
        for r in range(0, rows, step):
            yield (r, min(r + step, rows), 0, groups)
        return
    step = max(1, block_elems // length)
    for r in range(rows):
        for g in range(0, groups, step):
            yield (r, r + 1, g, min(g + step, groups))


Piece = tuple[tuple[int, int, int], slice, int, int]  # (part, its group columns, g0, g1)


def _row_walk(
    c: int, k: int, length: int, block_elems: int
) -> Iterator[tuple[int, int, list[Piece]]]:
    """(r0, r1, pieces) in flat order: whole rows of about block_elems elements with every part
    of them (the full groups, then the shorter last group), or, for rows longer than that, runs
    of groups of one row (a group is never split)."""
    parts = group_parts(k, length)
    if k <= block_elems:
        step = max(1, block_elems // k)
        for r0 in range(0, c, step):
            yield r0, min(r0 + step, c), [(part, cols, 0, part[1]) for part, cols in parts]
        return
    for r in range(c):
        for part, cols in parts:
            gstep = max(1, block_elems // part[2])
            for g0 in range(0, part[1], gstep):
                yield r, r + 1, [(part, cols, g0, min(g0 + gstep, part[1]))]


def _quantize_slabs(
    x: torch.Tensor,
    qparams: tuple[torch.Tensor, torch.Tensor],
    spec: QSpec,
    q: torch.Tensor,
    meas: Measure | None,
    block_elems: int,
    ws: Workspace,
    own_qparams: bool = True,
    minmax: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Quantize x slab by slab with qparams already known for every group (`own_qparams`:
    they were derived from x itself, so every value lies inside the range); `minmax`: the
    min-max qparams the mse search started from, whose error the report compares with."""
    shape = group_shape(tuple(x.shape), spec.axis)
    x3, q3 = x.view(shape), q.view(shape)
    scale3, zp3 = (t.reshape(1, -1, 1) for t in qparams)
    mm3 = tuple(t.reshape(1, -1, 1) for t in minmax) if minmax is not None else None
    for i0, i1, c0, c1, p0, p1 in _slabs(shape, block_elems):
        xf, work = ws.take(x3[i0:i1, c0:c1, p0:p1])  # a contiguous run, in flat order
        if meas is not None and mm3 is not None:
            error_of(xf, work, mm3[0][:, c0:c1], mm3[1][:, c0:c1], spec, ws)
            meas.add_minmax(work)
        q_slab = q3[i0:i1, c0:c1, p0:p1]
        s, z = scale3[:, c0:c1], zp3[:, c0:c1]
        _quantize_block(xf, work, s, z, spec, q_slab, meas, own_qparams, ws)
        if meas is not None:
            meas.add(xf, work)


def _quantize_block(
    xf: torch.Tensor,
    work: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    spec: QSpec,
    q_out: torch.Tensor,
    meas: Measure | None,
    own_qparams: bool,
    ws: Workspace,
) -> None:
    """One cache-resident slab (xf: float32 values, work: scratch of its shape): codes into
    q_out and, when measured, the error x - x_hat as restored into work. Every step in place."""
    # uint8 codes are built as int8 values q - 128 whose top bit is then flipped (q - 128 + 256
    # mod 256 = q): torch's float->uint8 cast runs ~3x slower than float->int8 on CPU.
    shift = 128 if spec.dtype is StorageDtype.UINT8 else 0
    torch.div(xf, scale, out=work)  # a division, not * (1/scale): bit-identical on CPU and CUDA
    work.round_()  # half to even
    general = spec.scheme is Scheme.ASYM or spec.dtype.packed or not own_qparams
    if general:
        work.add_(zero_point - shift).clamp_(spec.qmin - shift, spec.qmax - shift)
    # 8-bit symmetric with its own qparams: |x| <= amax, so |x / scale| <= 127 (1 + 2^-23) and
    # no clamp is needed; the rounded value already is q - zero_point = q - shift. (4-bit
    # symmetric maps amax to 7.5, which rounds to 8 and must be clamped to 7.)
    q_out.view(torch.int8).copy_(work)
    if shift:
        q_out.view(torch.uint8).bitwise_xor_(0x80)
    if meas is None:
        return
    if general:
        work.sub_(zero_point - shift)  # q - zero_point, exact in float32
    restored_error(xf, work, scale, ws)


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
    if x.dtype not in FLOAT_TORCH_DTYPES:
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


# -- the one dispatch: any codec's kernels --------------------------------------------------


Work = tuple[tuple[int, ...], bool, Codec]
"""One tensor a run will quantize: its shape, whether it is 16-bit (bf16/fp16), its spec."""


@dataclass(frozen=True)
class Kernels:
    """A codec family's numerics. `quantize(x, spec, *, with_errors, scale_dtype, workspace)`:
    codes, scales and zero points as the family stores them (and the error statistics of what
    a consumer restores); `restored(x, spec)`: that reconstruction as float32; `expect(device,
    work)`: told the run's work up front, to choose its kernels; `stacks`: tiny tensors of one
    spec may be quantized stacked, in one call."""

    quantize: Callable[..., QuantizedTensor]
    restored: Callable[[torch.Tensor, Any], torch.Tensor]
    expect: Callable[[torch.device, list[Work]], None]
    restore_rows: Callable[[QuantizedTensor, Any, int, int, torch.Tensor], torch.Tensor]
    stacks: bool = False


def quantize_with(
    x: torch.Tensor,
    spec: Codec,
    *,
    with_errors: bool = True,
    scale_dtype: torch.dtype = torch.float32,
    workspace: Workspace | None = None,
    weights: ColumnWeights | None = None,
) -> QuantizedTensor:
    """x quantized with `spec` by its family's kernels (see Kernels); `weights` (an importance
    matrix's h per input column) weigh a range search's errors where the family takes them."""
    extra = {} if weights is None else {"weights": weights}
    return family(spec).quantize(
        x, spec, with_errors=with_errors, scale_dtype=scale_dtype, workspace=workspace, **extra
    )


def restored(x: torch.Tensor, spec: Codec) -> torch.Tensor:
    """x quantized with `spec` and restored as a consumer does (in x's dtype for a grid, as
    ggml dequantizes for a GGUF type), as float32."""
    return family(spec).restored(x, spec)


def expect(device: torch.device, work: Iterable[Work]) -> None:
    """Tell every family what this run quantizes one tensor at a time on `device` (each
    chooses its kernels by the whole run's work: numerics/select.py)."""
    todo = list(work)
    for kind in FAMILIES:
        _load(kind).expect(device, [w for w in todo if w[2].kind == kind])


def restored_rows(
    result: QuantizedTensor, spec: Codec, a: int, b: int, x: torch.Tensor
) -> torch.Tensor:
    """Rows a:b (of the first dim) of a tensor as its codes in `result` restore it (`x`: those
    rows, for their shape and dtype): a grid's in x's dtype (the whole tensor when its qparams
    are not per row), a GGUF type's as ggml dequantizes its blocks (float32)."""
    return family(spec).restore_rows(result, spec, a, b, x)


def family(spec: Codec) -> Kernels:
    """The kernels of `spec`'s family."""
    return _load(spec.kind)


# -- the grid's kernels ---------------------------------------------------------------------


def _grid_quantize(
    x: torch.Tensor,
    spec: QSpec,
    *,
    with_errors: bool = True,
    scale_dtype: torch.dtype = torch.float32,
    workspace: Workspace | None = None,
    weights: ColumnWeights | None = None,
) -> QuantizedTensor:
    """The fused kernels where select.py chooses them, else the torch kernels, timed for that
    choice (the same bits either way)."""
    fused = select.fused_for(x, spec, weighted=weights is not None)
    if fused is not None:
        got: QuantizedTensor = fused.quantize_tensor(
            x, spec, with_errors=with_errors, scale_dtype=scale_dtype
        )
        return got
    started = time.perf_counter()
    result = quantize_tensor(
        x, spec, with_errors=with_errors, scale_dtype=scale_dtype, workspace=workspace,
        weights=weights,
    )  # fmt: skip
    select.measured(x, spec, started)
    return result


def _grid_restored(x: torch.Tensor, spec: QSpec) -> torch.Tensor:
    result = quantize_tensor(x, spec, with_errors=False)
    q, scale, zp = result.q, result.scale, result.zero_point
    return dequantize(q, scale, zp, spec, dtype=x.dtype, shape=x.shape).float()


def _grid_expect(device: torch.device, work: Sequence[Work]) -> None:
    grids = [
        select.Work(shape, wide, spec) for shape, wide, spec in work if isinstance(spec, QSpec)
    ]
    select.expect_work(device, grids)


def _grid_restore_rows(
    result: QuantizedTensor, spec: QSpec, a: int, b: int, x: torch.Tensor
) -> torch.Tensor:
    shape = tuple(x.shape)
    if isinstance(spec.granularity, PerGroup) or spec.granularity == PerChannel(0):
        q, scale, zp = result.q[a:b], result.scale[a:b], result.zero_point[a:b]
    else:
        q, scale, zp = result.q, result.scale, result.zero_point
    return dequantize_chosen(q, scale, zp, spec, x.dtype, shape)


def dequantize_chosen(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    spec: QSpec,
    dtype: torch.dtype,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """dequantize through the kernels numerics/select.py chooses (the same values, bit for
    bit), the torch calls timed for that choice."""
    fused = select.restorer_for(q.device, len(shape), spec)
    if fused is not None:
        fused_out: torch.Tensor = fused.dequantize_tensor(q, scale, zero_point, spec, dtype, shape)
        return fused_out
    started = time.perf_counter()
    out = dequantize(q, scale, zero_point, spec, dtype, shape=shape)
    select.restore_measured(q, shape, started)
    return out


GRID = Kernels(_grid_quantize, _grid_restored, _grid_expect, _grid_restore_rows, stacks=True)

FAMILIES: dict[str, Kernels | str] = {
    "grid": GRID,
    "gguf": "qtool.numerics.gguf.codec",  # its module's KERNELS
}


def _load(kind: str) -> Kernels:
    found = FAMILIES[kind]
    if isinstance(found, str):
        found = FAMILIES[kind] = importlib.import_module(found).KERNELS
    assert isinstance(found, Kernels)
    return found
