"""A run's WRITE mode (engine/run.py): every output checked before the data is read
(engine/layout.py), the plan's data passes, then each shard streamed through the format's
writer (engine/loop.py), then a directory's own files, companions and index; outputs appear
only complete (an OutputSet of files, or a directory published whole)."""

from __future__ import annotations

from collections.abc import Callable

from qtool.engine.budget import data_passes, needed_bytes
from qtool.engine.job import Done, Job
from qtool.engine.layout import Target, finish_directory, prepared
from qtool.engine.loop import write_shard
from qtool.engine.plan import ModelPlan
from qtool.engine.spill import Spill
from qtool.io.atomic import OutputSet
from qtool.results import QuantizeRow

Finish = Callable[[OutputSet, dict[str, str], int], None]
"""Writes a run's last files given the output index's weight map and total size."""


def write(job: Job, plan: ModelPlan) -> Done:
    """Every output of the run, for every format and layout: checked first, then the data
    passes, the shards, and (a directory output) the format's files, the companions and the
    index with the names the format stores each tensor under."""
    source, target, fmt, run = job.output.source, job.output.target, job.fmt, job.run
    needed, keep = needed_bytes(plan.plans, job.options), job.options.input_files
    with prepared(source, target, fmt.layout, run.force, run.also, needed, protect=keep) as place:
        placed = place.target
        with data_passes(job, plan, place.scratch) as (final, spill):

            def finish(outputs: OutputSet, weight_map: dict[str, str], total: int) -> None:
                if placed.directory is None:
                    return
                files = fmt.directory_files(final.plans)
                section = fmt.index_section(placed.shard_outputs)
                finish_directory(outputs, source, place, files, weight_map, total, section)

            rows = _write_shards(job, final, placed, spill, finish)
    return Done(final, rows, place.notes, place.stale)


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
