"""Sharded checkpoints: a `*.safetensors.index.json` (or a directory holding one) and its shards.

The output keeps the sharding: each shard becomes a quantized shard of the same name with its own
sidecar (`<shard stem>.qparams.safetensors`), a new index lists them (with `total_size` updated
and a `qtool` section naming the sidecars), and the directory's other files (config, tokenizer)
are copied along. Every shard header is validated before the first byte is written; the whole
directory set is committed at the end, the index last.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from qtool.engine import restore
from qtool.engine import run as pipeline
from qtool.engine.plan import QuantizeOptions, TensorPlan, plan_tensors, planned_row
from qtool.errors import InputError, OutputError
from qtool.formats.qtool import sidecar_path
from qtool.io.atomic import OutputSet, preflight, remove_stale_temps
from qtool.io.checkpoint import Checkpoint, open_checkpoint
from qtool.io.index import (
    INDEX_SUFFIX,
    ShardedInput,
    check_inside,
    companion_problem,
    default_output_dir,
    load_index,
)
from qtool.io.stformat import read_header
from qtool.results import DequantizeSummary, Progress, QuantizeSummary, TensorRow

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


def _prepare_outdir(outdir: Path, src_dir: Path, force: bool) -> bool:
    """Check the output directory; create it if needed. True when this run created it."""
    if outdir.exists() and os.path.samefile(outdir, src_dir):  # any spelling, link or mount
        raise OutputError(outdir, "is the input directory; choose another -o")
    if outdir.exists() and not outdir.is_dir():
        raise OutputError(outdir, "exists and is not a directory")
    if outdir.is_dir() and any(not p.name.startswith(".") for p in outdir.iterdir()) and not force:
        raise OutputError(outdir, "already exists and is not empty; pass --force to replace files")
    if not outdir.parent.is_dir():
        raise OutputError(outdir, f"directory {outdir.parent} does not exist; create it first")
    created = not outdir.exists()
    outdir.mkdir(exist_ok=True)
    return created


def _start_outputs(
    sharded: ShardedInput, outdir: Path, names: list[str], force: bool, also: Sequence[Path]
) -> bool:
    """Prepare `outdir` and preflight every output of the run (all names planned first, so
    collisions are refused before writing). True when this run created `outdir`."""
    created = _prepare_outdir(outdir, sharded.directory, force)
    try:
        outputs = [outdir / name for name in names] + list(also)
        preflight(outputs, _protected(sharded), force=force)
    except BaseException:
        if created:
            _remove_if_empty(outdir)
        raise
    return created


def _protected(sharded: ShardedInput) -> list[Path]:
    """Everything in the input directory (shards, sidecars, companions) and the index."""
    return [*sharded.directory.iterdir(), *pipeline.protected_paths([sharded.index])]


def _companion_files(sharded: ShardedInput) -> tuple[list[Path], list[str]]:
    """Files to copy along (config, tokenizer, ...): not weights, not the index, not hidden;
    only regular files inside the directory. Returns them and a note per file skipped."""
    files, notes = [], []
    for p in sorted(sharded.directory.iterdir()):
        if (
            p.name.startswith(".")
            or p == sharded.index
            or p.name.endswith(WEIGHT_SUFFIXES)
            or p.name.endswith(INDEX_SUFFIX)
            or (p.is_dir() and not p.is_symlink())
        ):
            continue
        why = companion_problem(sharded.directory, p)
        if why is None:
            files.append(p)
        else:
            notes.append(f"{p}: not copied: {why}")
    return files, notes


def _copy_into(outputs: OutputSet, src: Path, dest: Path) -> None:
    """Copy a companion: the resolved file, opened without following links, if regular."""
    try:
        fd = os.open(os.path.realpath(src), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        raise InputError(src, f"cannot read: {err.strerror}") from None
    with os.fdopen(fd, "rb") as fin:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError(src, "changed while reading: no longer a regular file")
        shutil.copyfileobj(fin, outputs.create(dest), 1 << 20)


def _write_index(
    outputs: OutputSet, sharded: ShardedInput, dest: Path, total: int, qtool: dict[str, object]
) -> None:
    doc = {k: v for k, v in sharded.raw.items() if k not in ("metadata", "weight_map", "qtool")}
    doc["metadata"] = {**sharded.metadata, "total_size": total}
    if qtool:
        doc["qtool"] = qtool
    doc["weight_map"] = dict(sorted(sharded.weight_map.items()))
    data = json.dumps(doc, indent=2, ensure_ascii=False).encode() + b"\n"
    outputs.create(dest, last=True).write(data)


def quantize_sharded(
    src: Path,
    out: Path | None,
    options: QuantizeOptions,
    *,
    device: str = "auto",
    force: bool = False,
    dry_run: bool = False,
    estimate: bool = False,
    progress: Progress | None = None,
    also: Sequence[Path] = (),
) -> QuantizeSummary:
    """Quantize every shard of a sharded checkpoint into `outdir`, keeping the sharding."""
    started = time.perf_counter()
    dev = pipeline.resolve_device(device)
    sharded = load_index(src)
    outdir = out or default_output_dir(sharded.index, options.spec.dtype.value)
    plans = _plan_shards(sharded, options)
    rows = [planned_row(p) for shard in sharded.shards for p in plans[shard]]
    outputs_named = [str(outdir)]
    if dry_run:
        preflight(also, _protected(sharded), force=force)
        if estimate:
            rows = _each_shard(
                sharded,
                plans,
                options.keep_nonfinite,
                lambda ckpt, shard_plans, _: pipeline.estimate_rows(ckpt, shard_plans, dev),
            )
        return _summary(sharded, outputs_named, rows, options, dev, started, dry_run=True)
    companions, notes = _companion_files(sharded)
    sidecars = {s: sidecar_path(outdir / s).name for s in sharded.shards}
    names = [*sharded.shards, *sidecars.values(), *(c.name for c in companions)]
    created = _start_outputs(sharded, outdir, [*names, sharded.index.name], force, also)
    try:
        stale = remove_stale_temps(outdir)
        if progress is not None:
            progress.start(sum(p.entry.nbytes for ps in plans.values() for p in ps))
        with OutputSet() as outputs:
            rows = _each_shard(
                sharded,
                plans,
                options.keep_nonfinite,
                lambda ckpt, shard_plans, shard: pipeline.write_quantized(
                    ckpt, shard_plans, outdir / shard, outputs, dev, progress
                ),
            )
            total = sum(r.bytes_out for r in rows)
            for companion in companions:
                _copy_into(outputs, companion, outdir / companion.name)
            qtool = {"format": "qtool.sharded", "format_version": 1, "sidecars": sidecars}
            _write_index(outputs, sharded, outdir / sharded.index.name, total, qtool)
            outputs.commit()
    except BaseException:
        if created:
            _remove_if_empty(outdir)
        raise
    summary = _summary(sharded, outputs_named, rows, options, dev, started)
    return replace(summary, stale_temps_removed=stale, notes=notes)


def _plan_shards(sharded: ShardedInput, options: QuantizeOptions) -> dict[str, list[TensorPlan]]:
    plans = {}
    for shard in sharded.shards:
        shard_path = sharded.directory / shard
        plans[shard] = plan_tensors(shard_path, read_header(shard_path).tensors, options)
    return plans


def _each_shard(
    sharded: ShardedInput,
    plans: dict[str, list[TensorPlan]],
    keep_nonfinite: bool,
    work: Callable[[Checkpoint, list[TensorPlan], str], list[TensorRow]],
) -> list[TensorRow]:
    """Open the shards one at a time and collect what `work` makes of each."""
    rows: list[TensorRow] = []
    for shard in sharded.shards:
        ckpt = open_checkpoint(sharded.directory / shard)
        try:
            shard_plans = plans[shard]
            if keep_nonfinite:
                shard_plans = pipeline.keep_nonfinite(ckpt, shard_plans)
            rows += work(ckpt, shard_plans, shard)
        finally:
            ckpt.close()
    return rows


def _summary(
    sharded: ShardedInput,
    outputs: list[str],
    rows: list[TensorRow],
    options: QuantizeOptions,
    dev: torch.device,
    started: float,
    dry_run: bool = False,
) -> QuantizeSummary:
    return QuantizeSummary(
        inputs=[str(sharded.index)],
        outputs=outputs,
        rows=rows,
        spec=options.spec.describe(),
        device=str(dev),
        dry_run=dry_run,
        seconds=time.perf_counter() - started,
    )


def _remove_if_empty(directory: Path) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(directory)


def dequantize_sharded(
    path: Path, outdir: Path | None, *, dtype: str = "original", force: bool = False
) -> DequantizeSummary:
    """Dequantize every shard of a quantized sharded checkpoint into `outdir`."""
    sharded = load_index(path)
    outdir = outdir or default_output_dir(sharded.index, "dequantized")
    for shard in sharded.shards:
        check_inside(sharded.directory, sidecar_path(sharded.directory / shard))
    companions, notes = _companion_files(sharded)
    pairs = [restore.open_quantized(sharded.directory / s) for s in sharded.shards]
    created = False
    try:
        names = [*sharded.shards, *(c.name for c in companions), sharded.index.name]
        created = _start_outputs(sharded, outdir, names, force, ())
        rows = []
        with OutputSet() as outputs:
            for shard, pair in zip(sharded.shards, pairs, strict=True):
                rows += restore.write_dequantized(pair, outdir / shard, outputs, dtype)
            for companion in companions:
                _copy_into(outputs, companion, outdir / companion.name)
            total = sum(r.bytes_out for r in rows)
            _write_index(outputs, sharded, outdir / sharded.index.name, total, {})
            outputs.commit()
    except BaseException:
        if created:
            _remove_if_empty(outdir)
        raise
    finally:
        for pair in pairs:
            pair.close()
    return DequantizeSummary(
        inputs=[str(sharded.index)],
        sidecars=[str(sidecar_path(sharded.directory / s)) for s in sharded.shards],
        outputs=[str(outdir)],
        rows=rows,
        notes=notes,
    )
