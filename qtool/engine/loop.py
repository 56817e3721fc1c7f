"""The quantize loop over one shard: read a tensor (zero-copy) -> quantize and measure -> hand it
to the format's writer, then the next. Nothing holds the whole shard. The plan is final before
the loop starts (engine/plan.py); the loop only carries it out.

Tensor k is handed to the writer by a background thread (io/writer.py) while tensor k+1 is
quantized: the write syscalls and the torch kernels both release the GIL. Tensors are read into
one reused buffer, large ones a slab of rows at a time (engine/slabs.py). Progress is reported
in bytes: the tensor's name as it starts (0 bytes), then its bytes as they are done, slab by
slab for a large one.
"""

from __future__ import annotations

import errno
from collections.abc import Collection, Iterator
from dataclasses import dataclass, replace

import torch

from qtool.engine import batch
from qtool.engine.decision import TensorPlan
from qtool.engine.importance import Importance, weighted_error
from qtool.engine.plan import planned_row
from qtool.engine.slabs import Reader, quantize_by_slabs, slab_rows
from qtool.engine.spill import Figures, Spill
from qtool.errors import DeviceError, InputError, NumericError
from qtool.formats.base import ShardWriter
from qtool.io.checkpoint import Checkpoint, tensor_bytes
from qtool.io.writer import BackgroundWriter
from qtool.numerics import select
from qtool.numerics.kernels import QuantizedTensor, Workspace, expect, quantize_with
from qtool.numerics.range_methods import ColumnWeights, GridOverflow
from qtool.numerics.ranges import NonFiniteInput
from qtool.results import Progress, QuantizeRow, WeightedError


def resolve_device(name: str) -> torch.device:
    """'auto' -> CUDA when available, else CPU; 'cuda' without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(
            None, f"device {name}: no CUDA device is available here; run on the CPU", hint="device"
        )
    return torch.device(name)


@dataclass(frozen=True)
class Kernels:
    """Where the kernels run, what they report progress to, and whether scales are rounded to
    the weight's dtype before the codes are computed (a format that stores them so)."""

    device: torch.device
    progress: Progress | None = None
    scales_in_weight_dtype: bool = False
    importance: Importance | None = None  # --imatrix: weighs the range search and the figures
    importance_notes: tuple[str, ...] = ()  # what matching it to the tensors has to say
    weighs_codes: bool = True  # False (--imatrix-use plan): it weighs the figures, not the codes

    def expect(self, plans: Collection[TensorPlan]) -> None:
        """Tell the kernel choice what this run quantizes one tensor at a time (tiny tensors
        go through the torch kernels a batch at a time: numerics/kernels.py)."""
        expect(self.device, [
            (p.entry.shape, p.entry.dtype in ("BF16", "F16"), p.spec)
            for p in plans
            if p.spec is not None and batch.layout(p) is None
        ])  # fmt: skip

    def notes(self, plans: Collection[TensorPlan] | None = None) -> list[str]:
        """What the imatrix's match to the tensors `plans` (the final plans) quantize and the
        kernel choice have to say about the run (a much faster path not taken)."""
        matched = self.importance_notes
        if self.importance is not None and plans is not None:
            matched = tuple(self.importance.notes(plans))
        return [*matched, *select.notes()]

    def weights(self, plan: TensorPlan) -> ColumnWeights | None:
        """The importance matrix's column weights for a quantized tensor (None: none): what
        its error figures and the allocation's output errors are weighted by."""
        if self.importance is None or plan.spec is None:
            return None
        return self.importance.weights(plan.entry.name, plan.entry.shape)

    def weights_for_codes(self, weights: ColumnWeights | None) -> ColumnWeights | None:
        """What of a tensor's `weights` the quantizer's search takes (None where the imatrix
        only plans)."""
        return weights if self.weighs_codes else None


def write_shard(
    ckpt: Checkpoint,
    plans: list[TensorPlan],
    writer: ShardWriter,
    kernels: Kernels,
    spill: Spill | None = None,
) -> list[QuantizeRow]:
    """Stream one shard's tensors to the writer in the order it takes them; rows in file order.
    A tensor the error budget already quantized comes from `spill`, not from the input."""
    by_name = {p.entry.name: p for p in plans}
    rows: dict[str, QuantizeRow] = {}
    order = [by_name[entry.name] for entry in writer.order]
    with BackgroundWriter(ckpt.release) as background:
        for plan, done, weighted in _results(ckpt, order, kernels, spill=spill):
            entry = plan.entry
            if done is None:
                changed = spill.take_float(entry.name) if spill is not None else None
                data = ckpt.raw(entry) if changed is None else tensor_bytes(changed)
                background.submit(entry, writer.keep, entry, data)
                rows[entry.name] = planned_row(plan)
            else:
                background.submit(entry, writer.quantized, entry, plan.spec, done.result)
                rows[entry.name] = replace(measured_row(plan, done.figures), weighted=weighted)
    ckpt.check_unchanged()
    writer.finish()
    return [rows[p.entry.name] for p in plans]


def estimate_rows(
    ckpt: Checkpoint, plans: list[TensorPlan], kernels: Kernels, spill: Spill | None = None
) -> list[QuantizeRow]:
    """The rows a real run would report, error figures included, without writing anything
    (the figures of the tensors the error budget measured come from `spill`)."""
    known = {}
    if spill is not None:
        for p in plans:
            found = spill.figures(p.entry.name, p.spec) if p.spec is not None else None
            if found is not None:
                known[p.entry.name] = found
    rows = []
    for plan, done, weighted in _results(ckpt, plans, kernels, skip=known.keys()):
        if plan.entry.name in known:
            rows.append(measured_row(plan, known[plan.entry.name]))
        else:
            row = planned_row(plan) if done is None else measured_row(plan, done.figures)
            rows.append(replace(row, weighted=weighted))
            ckpt.release(plan.entry)
    return rows


def measured_row(plan: TensorPlan, figures: Figures) -> QuantizeRow:
    return planned_row(plan, figures.errors, figures.scale_range)


def _results(
    ckpt: Checkpoint,
    order: list[TensorPlan],
    kernels: Kernels,
    *,
    spill: Spill | None = None,
    skip: Collection[str] = (),
) -> Iterator[tuple[TensorPlan, batch.Quantized | None, WeightedError | None]]:
    """Each plan in `order` with its result (None: kept as it is, or named in `skip`) and, with
    an importance matrix that has its entry, its activation-weighted error. A tensor
    the error budget already quantized comes from `spill`; tiny tensors are quantized a batch
    at a time (engine/batch.py), the others one by one in two alternating workspaces, so the
    codes being written are never the ones being computed."""
    workspaces = (Workspace(kernels.device), Workspace(kernels.device))
    tiny = batch.TinyBatches(ckpt, order, kernels.device, kernels.scales_in_weight_dtype)
    reader = Reader(kernels.progress)
    for k, plan in enumerate(order):
        name, nbytes = plan.entry.name, plan.entry.nbytes
        reader.advance(name, 0)  # the tensor now being processed
        if plan.spec is None or name in skip:
            reader.advance(name, nbytes)
            yield plan, None, None
            continue
        result = spill.take(name, plan.spec) if spill is not None else None
        done = tiny.take(k) if result is None else None
        weights = kernels.weights(plan)
        if done is None:
            if result is None:
                result = quantize_one(
                    ckpt, plan, workspaces[k % 2], kernels.scales_in_weight_dtype, reader,
                    weights=kernels.weights_for_codes(weights),
                )  # fmt: skip
            else:
                reader.advance(name, nbytes)
            done = batch.Quantized(result, (float(result.scale.min()), float(result.scale.max())))
        else:
            reader.advance(name, nbytes)
        weighted = None
        if weights is not None:
            weighted = weighted_error(ckpt, plan, done.result, weights)
        yield plan, done, weighted


def quantize_one(
    ckpt: Checkpoint,
    plan: TensorPlan,
    workspace: Workspace,
    scales_in_weight_dtype: bool = False,
    reader: Reader | None = None,
    *,
    weights: ColumnWeights | None = None,
) -> QuantizedTensor:
    """One tensor quantized as planned; NumericError naming the file and the tensor when its
    values cannot be (NaN/Inf, beyond float32, a grid that would overflow). With a `reader`,
    it is read into the reader's reused buffer (a large one a slab at a time, engine/slabs.py)
    and its bytes reported to the reader's progress as they are done. `weights`: an importance
    matrix's, for the range search."""
    assert plan.spec is not None
    try:
        if reader is None:
            return _quantize_whole(ckpt, plan, workspace, scales_in_weight_dtype, None, weights)
        rows = slab_rows(plan, workspace.device)
        if rows is not None:
            return quantize_by_slabs(
                ckpt, plan, rows, reader, workspace, scales_in_weight_dtype, weights
            )
        result = _quantize_whole(ckpt, plan, workspace, scales_in_weight_dtype, reader, weights)
        reader.advance(plan.entry.name, plan.entry.nbytes)
        return result
    except NonFiniteInput as err:
        if err.count == 0:  # finite float64 values whose float32 range overflows
            largest = float(ckpt.tensor(plan.entry).abs().max())
            raise NumericError(
                ckpt.path,
                f"holds {plan.entry.dtype} values beyond float32's range (largest magnitude "
                f"{largest:.3g}), which cannot be quantized in float32; "
                "exclude this tensor or rescale it",
                plan.entry.name,
                hint="exclude",
            ) from None
        raise NumericError(
            ckpt.path,
            f"has {err.count} NaN/Inf values, which cannot be quantized; fix the checkpoint, "
            "exclude this tensor, or keep such tensors as they are",
            plan.entry.name,
            hint=("exclude", "keep-nonfinite"),
        ) from None
    except GridOverflow as err:
        raise NumericError(ckpt.path, str(err), plan.entry.name, hint="exclude") from None
    except ValueError as err:
        raise NumericError(ckpt.path, str(err), plan.entry.name) from None
    except (MemoryError, OSError, RuntimeError) as err:  # read whole, or its codes: too big
        if isinstance(err, OSError) and err.errno != errno.ENOMEM:
            raise
        if isinstance(err, RuntimeError) and "can't allocate memory" not in str(err):
            raise  # torch's allocator says so in a RuntimeError
        sliced = reader is not None and slab_rows(plan, workspace.device) is not None
        what = "its codes" if sliced else "read whole to be quantized so"
        raise InputError(
            ckpt.path, f"its {plan.entry.nbytes:,} bytes do not fit in the memory qtool may use "
            f"({what}); free memory, raise the limit or exclude it",
            plan.entry.name, hint="exclude",
        ) from None  # fmt: skip


def _quantize_whole(
    ckpt: Checkpoint,
    plan: TensorPlan,
    workspace: Workspace,
    scales_in_weight_dtype: bool,
    reader: Reader | None,
    weights: ColumnWeights | None = None,
) -> QuantizedTensor:
    """The tensor read whole (into the reader's buffer when there is one) and quantized."""
    assert plan.spec is not None
    x = ckpt.tensor(plan.entry, reader.buffer if reader is not None else None)
    x = x.to(workspace.device)
    scale_dtype = x.dtype if scales_in_weight_dtype else torch.float32
    return quantize_with(
        x, plan.spec, workspace=workspace, scale_dtype=scale_dtype, weights=weights
    )
