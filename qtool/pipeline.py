"""Quantize a checkpoint file: the per-tensor loop, returning a summary.

One tensor at a time: read (zero-copy) -> quantize and measure -> write, then the next; nothing
holds the whole checkpoint. Everything is validated before the first output byte is written, and
outputs appear only complete (atomic.OutputSet). Knows nothing of Rich or Typer.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from qtool import kernels
from qtool.atomic import OutputSet, remove_stale_temps
from qtool.checkpoint import (
    Checkpoint,
    StreamingWriter,
    open_checkpoint,
    tensor_bytes,
)
from qtool.errors import DeviceError, NumericError, OutputError
from qtool.index import is_sharded
from qtool.plan import (
    QuantizeOptions,
    TensorPlan,
    default_quantized_path,
    plan_tensors,
    planned_row,
)
from qtool.sidecar import (
    DIGEST_KEY,
    SIDECAR_KEY,
    Manifest,
    Record,
    manifest_metadata,
    scale_name,
    sidecar_path,
    zero_point_name,
)
from qtool.stformat import TensorEntry, build_header
from qtool.summary import Progress, QuantizeSummary, TensorRow

_PLACEHOLDER_DIGEST = "0" * 64


def resolve_device(name: str) -> torch.device:
    """'auto' -> CUDA when available, else CPU; 'cuda' without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(
            None, "--device cuda: no CUDA device is available here; use --device cpu or auto"
        )
    return torch.device(name)


def check_output(out: Path, inputs: list[Path], force: bool, needed_bytes: int = 0) -> None:
    """Before any data is read: refuse an output that would overwrite an input or an existing
    file (without --force), or that cannot be written (missing, read-only, full directory)."""
    if not out.parent.is_dir():
        raise OutputError(out, f"directory {out.parent} does not exist; create it first")
    if out.is_dir():
        raise OutputError(out, "is a directory; give a file name with -o")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise OutputError(out, f"directory {out.parent} is not writable; choose another -o")
    free = shutil.disk_usage(out.parent).free
    if needed_bytes > free:
        raise OutputError(
            out,
            f"needs about {needed_bytes:,} bytes but {out.parent} has {free:,} free; "
            "free some space or write elsewhere with -o",
        )
    for src in inputs:
        if out.exists() and src.exists() and out.samefile(src):
            raise OutputError(out, "would overwrite the input; choose another -o")
    if out.exists() and not force:
        raise OutputError(out, "already exists; pass --force to replace it")


def _check_recordable_name(out: Path) -> None:
    """The quantized file records its own and its sidecar's names in UTF-8 metadata."""
    try:
        out.name.encode("utf-8")
    except UnicodeEncodeError:
        raise OutputError(
            out,
            "the output name is not valid UTF-8 and cannot be recorded in the file's metadata; "
            "choose a UTF-8 name with -o",
        ) from None


def quantize_path(
    src: Path,
    out: Path | None,
    options: QuantizeOptions,
    *,
    device: str = "auto",
    force: bool = False,
    dry_run: bool = False,
    estimate: bool = False,
    progress: Progress | None = None,
) -> QuantizeSummary:
    """Quantize a checkpoint file, or a sharded checkpoint (index file or its directory)."""
    from qtool import sharded  # imported here: sharded builds on this module

    run = sharded.quantize_sharded if is_sharded(src) else quantize_file
    return run(
        src,
        out,
        options,
        device=device,
        force=force,
        dry_run=dry_run,
        estimate=estimate,
        progress=progress,
    )


def quantize_file(
    src: Path,
    out: Path | None,
    options: QuantizeOptions,
    *,
    device: str = "auto",
    force: bool = False,
    dry_run: bool = False,
    estimate: bool = False,
    progress: Progress | None = None,
) -> QuantizeSummary:
    """Quantize the checkpoint `src` into `out` plus its sidecar. A dry run only plans (from
    the header); with `estimate` it also measures the error, and writes nothing either way."""
    started = time.perf_counter()
    dev = resolve_device(device)
    out = out or default_quantized_path(src, options.spec.dtype.value)
    ckpt = open_checkpoint(src)
    try:
        plans = plan_tensors(src, ckpt.entries, options)
        side = sidecar_path(out)
        if dry_run:
            if options.keep_nonfinite and estimate:
                plans = keep_nonfinite(ckpt, plans)
            rows = estimate_rows(ckpt, plans, dev) if estimate else [planned_row(p) for p in plans]
            return _summary(src, [out, side], rows, options, dev, ckpt, 0, started, dry_run=True)
        needed = sum(p.out_nbytes for p in plans)
        _check_recordable_name(out)
        for target in (out, side):
            check_output(target, [src], force, needed if target == out else 0)
        stale = remove_stale_temps(out.parent)
        if options.keep_nonfinite:
            plans = keep_nonfinite(ckpt, plans)
        if progress is not None:
            progress.start(sum(p.entry.nbytes for p in plans))
        with OutputSet() as outputs:
            rows = write_quantized(ckpt, plans, out, outputs, dev, progress)
            outputs.commit()
        return _summary(src, [out, side], rows, options, dev, ckpt, stale, started)
    finally:
        ckpt.close()


def _summary(
    src: Path,
    outs: list[Path],
    rows: list[TensorRow],
    options: QuantizeOptions,
    dev: torch.device,
    ckpt: Checkpoint,
    stale: int,
    started: float,
    dry_run: bool = False,
) -> QuantizeSummary:
    return QuantizeSummary(
        inputs=[str(src)],
        outputs=[str(p) for p in outs],
        rows=rows,
        spec=options.spec.describe(),
        device=str(dev),
        dry_run=dry_run,
        skipped=list(ckpt.skipped),
        stale_temps_removed=stale,
        seconds=time.perf_counter() - started,
    )


def write_quantized(
    ckpt: Checkpoint,
    plans: list[TensorPlan],
    out: Path,
    outputs: OutputSet,
    dev: torch.device,
    progress: Progress | None = None,
) -> list[TensorRow]:
    """Stream the quantized file and then its sidecar into `outputs`; rows in file order."""
    side = sidecar_path(out)
    metadata = carried_metadata(ckpt.metadata)
    metadata |= {SIDECAR_KEY: side.name, DIGEST_KEY: _PLACEHOLDER_DIGEST}
    specs = [(p.entry.name, p.out_dtype, p.entry.shape) for p in plans]
    header_bytes, header = build_header(specs, metadata)
    writer = StreamingWriter(outputs.create(out, last=True), header_bytes, header, out)
    by_name = {p.entry.name: p for p in plans}
    rows: dict[str, TensorRow] = {}
    qparams: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    # Tensor k is written by a background thread while tensor k+1 is quantized (the write
    # syscalls and the torch kernels both release the GIL). Two workspaces alternate, so the
    # codes being written are never the ones being computed.
    workspaces = (kernels.Workspace(dev), kernels.Workspace(dev))
    with _BackgroundWriter(writer, ckpt) as background:
        for k, entry in enumerate(header.tensors):
            plan = by_name[entry.name]
            if plan.spec is None:
                data = ckpt.raw(plan.entry)
                rows[entry.name] = planned_row(plan)
            else:
                result = _quantize_one(ckpt, plan, workspaces[k % 2])
                data = tensor_bytes(result.q.cpu())
                qparams[entry.name] = (result.scale.cpu(), result.zero_point.cpu())
                rows[entry.name] = _quantized_row(plan, result)
            background.write(plan.entry, data)
            if progress is not None:
                progress.advance(entry.name, plan.entry.nbytes)
    ckpt.check_unchanged()
    digest = _write_sidecar(outputs, side, out.name, by_name, qparams)
    final_header, _ = build_header(specs, metadata | {DIGEST_KEY: digest})
    writer.finish(final_header)
    return [rows[p.entry.name] for p in plans]


class _BackgroundWriter:
    """At most one write in flight: `write` waits for the previous one, then hands this one to
    a worker thread; leaving the context waits for the last (and re-raises its error)."""

    def __init__(self, writer: StreamingWriter, ckpt: Checkpoint) -> None:
        self._writer, self._ckpt = writer, ckpt
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qtool-write")
        self._pending: Future[None] | None = None

    def __enter__(self) -> _BackgroundWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._wait()
        finally:
            self._pool.shutdown(wait=True)

    def write(self, entry: TensorEntry, data: memoryview) -> None:
        self._wait()
        self._pending = self._pool.submit(self._write, entry, data)

    def _write(self, entry: TensorEntry, data: memoryview) -> None:
        self._writer.write(entry.name, data)
        self._ckpt.release(entry)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


def estimate_rows(ckpt: Checkpoint, plans: list[TensorPlan], dev: torch.device) -> list[TensorRow]:
    """The rows a real run would report, error figures included, without writing anything."""
    workspace = kernels.Workspace(dev)
    rows = []
    for plan in plans:
        if plan.spec is None:
            rows.append(planned_row(plan))
            continue
        rows.append(_quantized_row(plan, _quantize_one(ckpt, plan, workspace)))
        ckpt.release(plan.entry)
    return rows


def _quantize_one(
    ckpt: Checkpoint, plan: TensorPlan, workspace: kernels.Workspace
) -> kernels.QuantizedTensor:
    assert plan.spec is not None
    x = ckpt.tensor(plan.entry).to(workspace.device)
    try:
        return kernels.quantize_tensor(x, plan.spec, workspace=workspace)
    except kernels.NonFiniteInput as err:
        if err.count == 0:  # finite float64 values whose float32 range overflows
            raise NumericError(
                ckpt.path,
                f"holds {plan.entry.dtype} values beyond float32's range (largest magnitude "
                f"{float(x.abs().max()):.3g}), which cannot be quantized in float32; "
                "--exclude this tensor or rescale it",
                plan.entry.name,
            ) from None
        raise NumericError(
            ckpt.path,
            f"has {err.count} NaN/Inf values, which cannot be quantized; fix the checkpoint, "
            "--exclude this tensor, or pass --keep-nonfinite to keep such tensors as they are",
            plan.entry.name,
        ) from None
    except ValueError as err:
        raise NumericError(ckpt.path, str(err), plan.entry.name) from None


def keep_nonfinite(ckpt: Checkpoint, plans: list[TensorPlan]) -> list[TensorPlan]:
    """Turn plans whose tensor holds NaN/Inf into pass-throughs (one extra read of each)."""
    out = []
    for plan in plans:
        if plan.spec is not None:
            x = ckpt.tensor(plan.entry)
            lo, hi = torch.aminmax(x)  # no full-size temporaries; NaN/Inf show up here
            if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
                bad = int((~torch.isfinite(x)).sum())
                plan = plan.kept(f"{bad} NaN/Inf values (--keep-nonfinite)")
            ckpt.release(plan.entry)
        out.append(plan)
    return out


def _write_sidecar(
    outputs: OutputSet,
    side: Path,
    quantized_name: str,
    plans: dict[str, TensorPlan],
    qparams: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> str:
    """Write the sidecar; return the SHA-256 of its data section."""
    records = {name: _record(plans[name]) for name in sorted(qparams)}
    tensors: dict[str, torch.Tensor] = {}
    for name, (scale, zero_point) in qparams.items():
        tensors[scale_name(name)] = scale
        tensors[zero_point_name(name)] = zero_point
    metadata = manifest_metadata(Manifest(quantized_name, records))
    specs = [(n, _st_dtype(t), tuple(t.shape)) for n, t in tensors.items()]
    header_bytes, header = build_header(specs, metadata)
    writer = StreamingWriter(outputs.create(side), header_bytes, header, side)
    digest = hashlib.sha256()
    for entry in header.tensors:
        data = tensor_bytes(tensors[entry.name])
        digest.update(data)
        writer.write(entry.name, data)
    writer.finish()
    return digest.hexdigest()


def _record(plan: TensorPlan) -> Record:
    spec = plan.spec
    assert spec is not None
    return Record(
        scheme=spec.scheme.value,
        dtype=spec.dtype.value,
        axis=spec.axis,
        qmin=spec.qmin,
        qmax=spec.qmax,
        orig_dtype=plan.entry.dtype,
        shape=plan.entry.shape,
    )


def _st_dtype(t: torch.Tensor) -> str:
    return {torch.float32: "F32", torch.int8: "I8", torch.uint8: "U8"}[t.dtype]


def carried_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    """The input's own metadata (e.g. {"format": "pt"}), minus qtool's keys."""
    return {k: v for k, v in (metadata or {}).items() if not k.startswith("qtool.")}


def _quantized_row(plan: TensorPlan, result: kernels.QuantizedTensor) -> TensorRow:
    scale_range = (float(result.scale.min()), float(result.scale.max()))
    return replace(planned_row(plan), errors=result.errors, scale_range=scale_range)
