"""Large tensors quantized a slab of rows at a time, each slab read into one reused buffer.

Per channel (axis 0) and per group, every row of the [C, K] view is quantized on its own: its
range, qparams, codes (4-bit packing runs along the row) and error sums come from that row
alone. So a tensor of more than SLAB_BYTES is read SLAB_BYTES of rows at a time into the
loop's ReadBuffer and each slab is quantized as a tensor of those rows; the codes go to their
place in the tensor's code buffer, the qparams and the --range mse choices are concatenated,
the error sums added. The codes and qparams are those of one call on the whole tensor, bit for
bit; the float64 error sums are added in another order (a difference of an ulp or two).
Memory: one slab instead of the whole tensor, in memory already touched; and progress moves
within the tensor, slab by slab.

A GGUF block type is the same case: ggml quantizes each row (the last dimension, whole blocks)
on its own, so a slab of rows gives its rows' blocks, which go to their place in the (rows,
row_bytes) code buffer, and the block scales are concatenated: the bytes of one call on the
whole tensor. Only the codes (the output's own size) are held whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from qtool.engine.decision import TensorPlan
from qtool.io.checkpoint import ST_TO_TORCH, Checkpoint
from qtool.io.readbuffer import ReadBuffer
from qtool.numerics import kernels
from qtool.numerics.kernels import QuantizedTensor, quantize_with
from qtool.numerics.range_methods import ColumnWeights
from qtool.numerics.ranges import NonFiniteInput
from qtool.results import Progress, combine

SLAB_BYTES = 16 << 20  # below glibc's 32 MiB mmap threshold: the kernels' slab-sized arrays
# are recycled by malloc instead of being mapped (and faulted) afresh for every slab


@dataclass
class Reader:
    """What the loop reads tensors with: the reused buffer, a workspace for the kernels' calls
    on slabs, and where progress goes (bytes, as slabs are done)."""

    progress: Progress | None = None
    buffer: ReadBuffer = field(default_factory=ReadBuffer)
    slab_workspace: kernels.Workspace = field(default_factory=kernels.Workspace)

    def advance(self, name: str, nbytes: int) -> None:
        if self.progress is not None:
            self.progress.advance(name, nbytes)


def slab_rows(plan: TensorPlan, device: torch.device) -> int | None:
    """Rows per slab when the tensor is read and quantized a slab at a time (a CPU run, rows
    quantized on their own: per channel, per group or a GGUF block type; over SLAB_BYTES, at
    least two slabs); None: read it whole."""
    spec, entry = plan.spec, plan.entry
    if spec is None or device.type != "cpu" or len(entry.shape) < 2 or entry.numel == 0:
        return None
    if not spec.rows_alone or entry.nbytes <= SLAB_BYTES:
        return None
    rows = max(1, SLAB_BYTES // (entry.nbytes // entry.shape[0]))
    return rows if rows < entry.shape[0] else None


def quantize_by_slabs(
    ckpt: Checkpoint,
    plan: TensorPlan,
    rows: int,
    reader: Reader,
    out: kernels.Workspace,
    weight_dtype: bool,
    weights: ColumnWeights | None = None,
) -> QuantizedTensor:
    """The tensor quantized `rows` rows at a time (see the module doc); its codes live in
    `out` (valid until the next call with it). `weights`: an importance matrix's, for the
    range search (a slab takes its rows' own)."""
    spec, entry = plan.spec, plan.entry
    assert spec is not None
    dtype = ST_TO_TORCH[entry.dtype]
    scale_dtype = dtype if weight_dtype else torch.float32
    codes, per_row = _codes(plan, out)
    parts: list[QuantizedTensor] = []
    for start in range(0, entry.shape[0], rows):
        stop = min(start + rows, entry.shape[0])
        x = ckpt.rows(entry, start, stop, reader.buffer)
        try:
            part = quantize_with(
                x, spec, workspace=reader.slab_workspace, scale_dtype=scale_dtype,
                weights=weights.rows(start, stop) if weights is not None else None,
            )  # fmt: skip
        except NonFiniteInput as err:
            raise NonFiniteInput(err.count and _nonfinite(ckpt, plan, reader)) from None
        codes[start * per_row : stop * per_row].copy_(part.q)
        parts.append(_without_codes(part))
        reader.advance(entry.name, x.numel() * x.element_size())
    return _joined(parts, codes)


def _codes(plan: TensorPlan, out: kernels.Workspace) -> tuple[torch.Tensor, int]:
    """The tensor's code buffer in `out` and how many of its rows one row of the tensor's
    first dimension gives: 1 for qtool's grids (codes in the tensor's shape, 4-bit packed),
    the rows of the other dimensions but the last for a GGUF type ((rows, row_bytes) blocks).
    MemoryError when even the codes do not fit."""
    spec, shape = plan.spec, plan.entry.shape
    assert spec is not None
    stored, dtype, per_row = spec.code_layout(shape)
    try:
        return out.codes(stored, ST_TO_TORCH[dtype]), per_row
    except RuntimeError as err:  # torch's allocator: "can't allocate memory"
        if "can't allocate memory" not in str(err):
            raise
        raise MemoryError(str(err)) from None


def _without_codes(part: QuantizedTensor) -> QuantizedTensor:
    """A slab's result without its codes (they live in the kernels' reused memory)."""
    empty = torch.empty(0, dtype=part.q.dtype)
    return QuantizedTensor(empty, part.scale, part.zero_point, part.errors, part.choice)


def _joined(parts: list[QuantizedTensor], codes: torch.Tensor) -> QuantizedTensor:
    """The slabs' results as one tensor's: qparams and choices joined along the rows."""
    errors = [p.errors for p in parts if p.errors is not None]
    choices = [p.choice for p in parts if p.choice is not None]
    return QuantizedTensor(
        codes,
        torch.cat([p.scale for p in parts]),
        torch.cat([p.zero_point for p in parts]),
        combine(errors) if len(errors) == len(parts) else None,
        torch.cat(choices) if len(choices) == len(parts) else None,
    )


def _nonfinite(ckpt: Checkpoint, plan: TensorPlan, reader: Reader) -> int:
    """NaN/Inf values in the whole tensor (a slab's error counts only its own), slab by slab."""
    entry = plan.entry
    rows = max(1, SLAB_BYTES // max(1, entry.nbytes // entry.shape[0]))
    bad = 0
    for start in range(0, entry.shape[0], rows):
        x = ckpt.rows(entry, start, min(start + rows, entry.shape[0]), reader.buffer)
        bad += int(math.prod(x.shape)) - int(torch.isfinite(x).sum())
    return bad
