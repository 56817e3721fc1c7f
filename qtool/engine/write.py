"""A run's WRITE mode (engine/run.py): every output checked before the data is read, the plan's
data passes, then each shard streamed through the format's writer (engine/loop.py); outputs
appear only complete (io/atomic.OutputSet, or a model directory renamed into place)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from qtool.engine.budget import data_passes, needed_bytes
from qtool.engine.job import Done, Job
from qtool.engine.loop import write_shard
from qtool.engine.model_dir import (
    building,
    check_output_dir,
    companions,
    companions_bytes,
    finish_model_directory,
    model_target,
)
from qtool.engine.plan import ModelPlan
from qtool.engine.source import Target, finish_directory, prepared
from qtool.engine.spill import Spill
from qtool.errors import OutputError
from qtool.formats.qtool import sidecar_path
from qtool.io.atomic import OutputSet, preflight, remove_stale_temps
from qtool.results import QuantizeRow

Finish = Callable[[OutputSet, dict[str, str], int], None]
"""Writes a run's last files given the output index's weight map and total size."""


def write_files(job: Job, plan: ModelPlan) -> Done:
    """qtool's outputs: every file checked (a sharded run's directory made) before the data is
    read, the stale temporary files of killed runs removed, then the shards and the index."""
    output, run = job.output, job.run
    needed = needed_bytes(plan.plans, job.options)
    for out_file in output.target.shard_outputs:
        _check_recordable_name(out_file)
    with prepared(
        output.source, output.target, job.fmt.layout, run.force, run.also, needed
    ) as notes:
        directory = output.target.directory or output.target.shard_outputs[0].parent
        stale = remove_stale_temps(directory)
        with data_passes(job, plan, directory) as (plan, spill):
            section = _index_section(output.target)

            def finish(outputs: OutputSet, weight_map: dict[str, str], total: int) -> None:
                finish_directory(outputs, output.source, output.target, total, section)

            rows = _write_shards(job, plan, output.target, spill, finish)
    return Done(plan, rows, notes, stale)


def write_model(job: Job, plan: ModelPlan) -> Done:
    """A model directory, built under a temporary name and renamed when complete: the shards,
    the format's own files (config.json), the companions, and the index with the names the
    format stores each tensor under."""
    model, run, out = job.output.model, job.run, job.output.target.directory
    assert model is not None and out is not None
    check_output_dir(out, model, run.force)
    preflight(run.also, model.source.protected, force=run.force)
    notes = companions(model)[1]
    with building(out, model, run.force) as temp:
        target = model_target(model, temp)
        needed = needed_bytes(plan.plans, job.options) + companions_bytes(model)
        preflight(list(target.shard_outputs), [], force=False, needed_bytes=needed)
        with data_passes(job, plan, temp.parent) as (plan, spill):
            final = plan

            def finish(outputs: OutputSet, weight_map: dict[str, str], total: int) -> None:
                files = job.fmt.directory_files(final.plans)
                finish_model_directory(outputs, model, temp, files, weight_map, total)

            rows = _write_shards(job, plan, target, spill, finish)
    return Done(plan, rows, notes)


def _write_shards(
    job: Job, plan: ModelPlan, target: Target, spill: Spill | None, finish: Finish
) -> list[QuantizeRow]:
    """Every shard through the format's writer, then `finish`; committed only when all is."""
    kernels, fmt = job.kernels, job.fmt
    assert kernels is not None
    kernels.expect(plan.plans)
    if kernels.progress is not None:
        kernels.progress.start(sum(p.entry.nbytes for p in plan.plans))
    rows: list[QuantizeRow] = []
    weight_map: dict[str, str] = {}
    with OutputSet() as outputs:
        for (shard, plans), out in zip(plan.per_shard(), target.shard_outputs, strict=True):
            ckpt = job.shards.checkpoint(shard)
            writer = fmt.writer(plans, ckpt.metadata, out, outputs)
            rows += write_shard(ckpt, plans, writer, kernels, spill)
            weight_map |= {n: out.name for p in plans for n in fmt.tensor_names(p)}
            job.shards.done(shard)
        finish(outputs, weight_map, sum(r.bytes_out for r in rows))
        outputs.commit()
    return rows


def _index_section(target: Target) -> dict[str, object]:
    sidecars = {out.name: sidecar_path(out).name for out in target.shard_outputs}
    return {"format": "qtool.sharded", "format_version": 1, "sidecars": sidecars}


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
