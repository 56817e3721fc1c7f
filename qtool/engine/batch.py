"""Tiny tensors quantized together: one set of kernel calls for many tensors (issue 12).

A kernel call costs ~0.3 ms of eager-torch overhead whatever the tensor's size, so 50,000 tiny
tensors cost 15 s of overhead alone. Tiny tensors of the same dtype, row length and spec are
stacked as the rows of one matrix and quantized in one call. This changes no byte: every
supported granularity quantizes rows independently (per channel on axis 0 and per group: the
rows of each tensor's [C, K] view; per tensor: the whole tensor as one row), and each row's
range, qparams and codes come from elementwise float32 operations and exact min/max reductions,
which do not depend on the rows beside it. 4-bit codes join only where packing along the
stacked rows is packing along the tensor's own last dimension. The error figures are each
tensor's own, by numerics/metrics.py's definition (x_hat rounded to the tensor's dtype, the
tensor's canonical chunks), so they equal the one-tensor path's to the last bit.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch

from qtool.engine.decision import TensorPlan
from qtool.engine.spill import Figures
from qtool.io.checkpoint import Checkpoint
from qtool.numerics import kernels, metrics
from qtool.numerics.packing import unpack_nibbles
from qtool.numerics.views import row_group_length
from qtool.results import ErrorStats
from qtool.spec import (
    PerChannel,
    PerGroup,
    PerTensor,
    QSpec,
    RangeMethod,
    as_grid,
    matrix_shape,
    packed_shape,
    qparam_shape,
)

TINY_ELEMS = 1 << 14  # tensors of at most this many elements are batched with others
BATCH_ELEMS = 1 << 16  # elements per batch (256 KiB of float32: stays in cache)


@dataclass(frozen=True)
class Layout:
    """How one tensor joins a batch: the batch it may share (`key`) and its rows there."""

    key: tuple[str, int, QSpec]  # input dtype, row length, the spec the batch is quantized with
    rows: int


@dataclass(frozen=True)
class Quantized:
    """One tensor's share of a batch, as the one-tensor path would have returned it."""

    result: kernels.QuantizedTensor
    scale_range: tuple[float, float]

    @property
    def figures(self) -> Figures:
        return Figures(self.result.errors, self.scale_range)


class TinyBatches:
    """The results of a shard's tiny tensors, computed a batch at a time just before the loop
    reaches the first of them (later tensors of the batch wait, as tiny results, for their
    turn)."""

    def __init__(
        self, ckpt: Checkpoint, order: Sequence[TensorPlan], device: torch.device,
        weight_dtype: bool,
    ) -> None:  # fmt: skip
        self._ckpt, self._order, self._device = ckpt, order, device
        self._weight_dtype = weight_dtype
        self._layouts = [layout(p) for p in order]
        self._ready: dict[int, Quantized | None] = {}

    def take(self, k: int) -> Quantized | None:
        """The result of the k-th tensor of the order; None: quantize it on its own."""
        if k not in self._ready and self._layouts[k] is not None:
            self._ready.update(self._batch_from(k))
        return self._ready.pop(k, None)

    def _window(self, k: int) -> list[int]:
        """Tiny tensors from k on (others skipped), BATCH_ELEMS elements at most."""
        window: list[int] = []
        elems = 0
        for j in range(k, len(self._order)):
            if self._layouts[j] is None or j in self._ready:
                continue
            elems += self._order[j].entry.numel
            if elems > BATCH_ELEMS:
                break
            window.append(j)
        return window

    def _batch_from(self, k: int) -> dict[int, Quantized | None]:
        """Results for the window starting at k, one kernel call per layout key; a batch the
        kernel refuses (NaN, overflow) is left to the one-tensor path, which names the tensor."""
        buckets: dict[tuple[str, int, QSpec], list[tuple[int, Layout]]] = {}
        for j in self._window(k):
            lay = self._layouts[j]
            assert lay is not None
            buckets.setdefault(lay.key, []).append((j, lay))
        done: dict[int, Quantized | None] = {}
        for members in buckets.values():
            indices = [j for j, _ in members]
            done |= dict.fromkeys(indices)
            try:
                results = self._quantize(members)
            except ValueError:  # NonFiniteInput, GridOverflow, overflowing ranges
                continue
            done |= dict(zip(indices, results, strict=True))
        return done

    def _quantize(self, members: list[tuple[int, Layout]]) -> list[Quantized]:
        plans = [self._order[j] for j, _ in members]
        xs = self._ckpt.tensors([p.entry for p in plans])
        layouts = [lay for _, lay in members]
        with _one_thread():
            return quantize_batch(xs, plans, layouts, self._device, self._scale_dtype)

    def _scale_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self._weight_dtype else torch.float32


@functools.cache
def _rows_of(spec: QSpec) -> QSpec:
    """The spec a batch of whole tensors is quantized with: one row per tensor."""
    return replace(spec, granularity=PerChannel(0))


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch's intra-op threads off: no operation on a batch is worth a hand-off to the thread
    pool, and on a machine whose cores are busy each hand-off waits milliseconds for a worker to
    be scheduled (measured here: 10 ms per call of round_ on 8,000 elements, 2 threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def layout(plan: TensorPlan) -> Layout | None:
    """The tensor's place in a batch; None when it is quantized on its own (not tiny, the mse
    search, per channel on another axis, 4-bit codes whose packing stacking would change, or
    chosen by the error budget)."""
    spec, entry = plan.spec, plan.entry
    if plan.decision.budget:  # the error budget quantized it already (engine/spill.py)
        return None
    if spec is None or not kernels.family(spec).stacks:  # GGUF blocks: numerics/gguf, one by one
        return None
    assert isinstance(spec, QSpec)  # the one family that stacks: the grid's kernels
    if not entry.shape or entry.numel == 0 or entry.numel > TINY_ELEMS:
        return None
    if spec.range_method is not RangeMethod.MINMAX:
        return None
    g, shape = spec.granularity, entry.shape
    if isinstance(g, PerTensor):
        rows, k, spec = 1, entry.numel, _rows_of(spec)
    elif len(shape) >= 2 and (isinstance(g, PerGroup) or g == PerChannel(0)):
        rows, k = matrix_shape(shape)
    else:
        return None
    if spec.dtype.packed and shape[-1] % 2 and shape[-1] != k:
        return None
    return Layout((entry.dtype, k, spec), rows)


def quantize_batch(
    xs: Sequence[torch.Tensor],
    plans: Sequence[TensorPlan],
    layouts: Sequence[Layout],
    device: torch.device,
    scale_dtype: Callable[[torch.dtype], torch.dtype],
) -> list[Quantized]:
    """Quantize tensors sharing one layout key in one kernel call; one result per tensor.
    Raises what the kernel raises (the caller then quantizes them one by one to name the
    tensor)."""
    _, k, spec = layouts[0].key
    rows = [lay.rows for lay in layouts]
    x = torch.cat([t.reshape(r, k) for t, r in zip(xs, rows, strict=True)]).to(device)
    result = kernels.quantize_tensor(x, spec, with_errors=False, scale_dtype=scale_dtype(x.dtype))
    segments = _Segments(rows)
    shapes = [plan.entry.shape for plan in plans]
    errors = _errors(x, result, spec, segments, shapes)
    lows, highs = segments.extremes(result.scale.reshape(len(x), -1))
    parts = zip(
        plans,
        result.q.split_with_sizes(rows),
        result.scale.split_with_sizes(rows),
        result.zero_point.split_with_sizes(rows),
        errors,
        zip(lows, highs, strict=True),
        strict=True,
    )
    return [
        Quantized(kernels.QuantizedTensor(*_shaped(plan, q, s, z), errors=e), extremes)
        for plan, q, s, z, e, extremes in parts
    ]


def _shaped(
    plan: TensorPlan, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tensor's rows of a batch result in the shapes of its own result: codes as stored,
    qparams in the granularity's shape (batched specs have no other channel axis than 0)."""
    assert plan.spec is not None
    spec, shape = as_grid(plan.spec), plan.entry.shape
    stored = packed_shape(shape) if spec.dtype.packed else shape
    qshape = qparam_shape(spec.granularity, shape)
    return q.view(stored), scale.view(qshape), zero_point.view(qshape)


class _Segments:
    """Consecutive runs of rows, one per tensor: per-tensor sums and extremes of row values
    (numpy's reduceat, in row order; a tensor's rows are few, the batch's tensors many)."""

    def __init__(self, rows: list[int]) -> None:
        self.starts = [0, *itertools.accumulate(rows[:-1])]
        self.ends = [*self.starts[1:], self.starts[-1] + rows[-1]]

    def reduce(self, per_row: torch.Tensor, how: np.ufunc) -> list[float]:
        values = per_row.cpu().numpy()
        return how.reduceat(values, self.starts).tolist()  # type: ignore[no-any-return]

    def extremes(self, values: torch.Tensor) -> tuple[list[float], list[float]]:
        """Per tensor (min, max) of a [rows, n] tensor."""
        return self.reduce(values.amin(1), np.minimum), self.reduce(values.amax(1), np.maximum)


def _errors(
    x: torch.Tensor,
    result: kernels.QuantizedTensor,
    spec: QSpec,
    segments: _Segments,
    shapes: Sequence[tuple[int, ...]],
) -> list[ErrorStats]:
    """Per tensor error figures of a batch, as the one-tensor path gives them (metrics.py):
    x_hat = (q - zp) * scale in float32 rounded to x's dtype, e = x - x_hat in float32, each
    tensor's squares summed by its own chunks, its largest |e|."""
    xf = x.float()
    rows, k = x.shape
    codes = result.q
    if spec.dtype.packed:
        codes = unpack_nibbles(codes, k, spec.dtype.signed)
    length = row_group_length(spec, tuple(x.shape))
    assert length is not None
    scale, zero_point = (_per_element(t, length, k) for t in (result.scale, result.zero_point))
    error = codes.float().sub_(zero_point).mul_(scale)  # x_hat in float32
    metrics.restore_(error, x.dtype)
    torch.sub(xf, error, out=error)
    tensors = [(start * k, shape) for start, shape in zip(segments.starts, shapes, strict=True)]
    sq_error = metrics.tensor_sums(error, tensors)
    sq_signal = metrics.tensor_sums(xf, tensors)
    max_abs = segments.reduce(error.abs_().amax(1), np.maximum)
    numel = [(end - start) * k for start, end in zip(segments.starts, segments.ends, strict=True)]
    figures = zip(numel, sq_error, sq_signal, max_abs, strict=True)
    return [ErrorStats(n, e, s, m) for n, e, s, m in figures]


def _per_element(qparam: torch.Tensor, length: int, k: int) -> torch.Tensor:
    """A [rows, groups] qparam as float32 [rows, k]: each group's value over its elements."""
    rows = qparam.reshape(len(qparam), -1).float()
    return rows.repeat_interleave(length, dim=1)[:, :k]
