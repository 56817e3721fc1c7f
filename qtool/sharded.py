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
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from qtool import pipeline, restore
from qtool.atomic import OutputSet, remove_stale_temps
from qtool.checkpoint import Checkpoint, open_checkpoint
from qtool.detect import refuse_quantized
from qtool.errors import OutputError
from qtool.index import INDEX_SUFFIX, ShardedInput, default_output_dir, load_index
from qtool.plan import QuantizeOptions, TensorPlan, plan_tensors, planned_row
from qtool.sidecar import sidecar_path
from qtool.stformat import read_header
from qtool.summary import DequantizeSummary, Progress, QuantizeSummary, TensorRow

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


def _prepare_outdir(outdir: Path, src_dir: Path, force: bool) -> bool:
    """Check the output directory; create it if needed. True when this run created it."""
    if outdir.exists() and outdir.resolve() == src_dir.resolve():
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


def _companion_files(sharded: ShardedInput) -> list[Path]:
    """Files to copy along (config, tokenizer, ...): not weights, not the index, not hidden."""
    return sorted(
        p
        for p in sharded.directory.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and p != sharded.index
        and not p.name.endswith(WEIGHT_SUFFIXES)
        and not p.name.endswith(INDEX_SUFFIX)
    )


def _copy_into(outputs: OutputSet, src: Path, dest: Path) -> None:
    with open(src, "rb") as fin:
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
    path: Path,
    outdir: Path | None,
    options: QuantizeOptions,
    *,
    device: str = "auto",
    force: bool = False,
    dry_run: bool = False,
    estimate: bool = False,
    progress: Progress | None = None,
) -> QuantizeSummary:
    """Quantize every shard of a sharded checkpoint into `outdir`, keeping the sharding."""
    started = time.perf_counter()
    dev = pipeline.resolve_device(device)
    sharded = load_index(path)
    outdir = outdir or default_output_dir(sharded.index, options.spec.dtype.value)
    plans = _plan_shards(sharded, options)
    rows = [planned_row(p) for shard in sharded.shards for p in plans[shard]]
    outputs_named = [str(outdir)]
    if dry_run:
        if estimate:
            rows = _each_shard(
                sharded,
                plans,
                options.keep_nonfinite,
                lambda ckpt, shard_plans, _: pipeline.estimate_rows(ckpt, shard_plans, dev),
            )
        return _summary(sharded, outputs_named, rows, options, dev, started, dry_run=True)
    created = _prepare_outdir(outdir, sharded.directory, force)
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
            for companion in _companion_files(sharded):
                _copy_into(outputs, companion, outdir / companion.name)
            sidecars = {s: sidecar_path(outdir / s).name for s in sharded.shards}
            qtool = {"format": "qtool.sharded", "format_version": 1, "sidecars": sidecars}
            _write_index(outputs, sharded, outdir / sharded.index.name, total, qtool)
            outputs.commit()
    except BaseException:
        if created:
            _remove_if_empty(outdir)
        raise
    summary = _summary(sharded, outputs_named, rows, options, dev, started)
    return replace(summary, stale_temps_removed=stale)


def _plan_shards(sharded: ShardedInput, options: QuantizeOptions) -> dict[str, list[TensorPlan]]:
    plans = {}
    for shard in sharded.shards:
        shard_path = sharded.directory / shard
        header = read_header(shard_path)
        refuse_quantized(shard_path, header.metadata, [t.name for t in header.tensors])
        plans[shard] = plan_tensors(shard_path, header.tensors, options)
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
        spec=options.spec,
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
    pairs = [restore.open_quantized(sharded.directory / s) for s in sharded.shards]
    created = False
    try:
        created = _prepare_outdir(outdir, sharded.directory, force)
        rows = []
        with OutputSet() as outputs:
            for shard, pair in zip(sharded.shards, pairs, strict=True):
                rows += restore.write_dequantized(pair, outdir / shard, outputs, dtype)
            for companion in _companion_files(sharded):
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
    )
