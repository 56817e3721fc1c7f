"""`quantize`: one function for every input and output, in one of three modes (job.Mode).

A single file is a one-shard source, a sharded checkpoint its index and shards; the output is
what the format writes (qtool: a file and its sidecar per shard; compressed-tensors: a model
directory). Every run plans from the headers first (engine/plan.py, passes 1-3); a PLAN stops
there, an ESTIMATE reads and measures (passes 4-7, then the loop without a writer), a WRITE
checks its outputs, then does the same with the format's writer (engine/write.py).

Torch-free at import: the modules that need torch are imported when the mode needs them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.engine.decision import TensorPlan
from qtool.engine.job import Done, Job, Mode, Output, RunOptions
from qtool.engine.model_dir import model_target, open_model
from qtool.engine.plan import (
    ModelPlan,
    QuantizeOptions,
    default_quantized_path,
    output_tag,
    plan_headers,
    planned_row,
    quantized_output,
)
from qtool.engine.shards import Shards
from qtool.engine.source import open_source, target_for
from qtool.errors import UsageError
from qtool.formats import output_format
from qtool.formats.base import FormatContext, OutputFormat
from qtool.io.atomic import preflight, refuse_file_name_for_directory
from qtool.results import QuantizeRow, QuantizeSummary
from qtool.spec import FormatName

if TYPE_CHECKING:
    from qtool.engine.loop import Kernels


def quantize(
    src: Path, out: Path | None, options: QuantizeOptions, run: RunOptions
) -> QuantizeSummary:
    """Quantize `src` into `out`, or only plan it, or estimate it (see Mode)."""
    started = time.perf_counter()
    if run.mode is Mode.PLAN and options.target_sqnr is not None:
        raise UsageError(
            None,
            "the error budget measures each tensor, which a plan from headers does not",
            hint="estimate",
        )
    output = _output(src, out, options)
    fmt = _format(options, output)
    kernels = None if run.mode is Mode.PLAN else _kernels(run, fmt)
    shards = Shards(output.source, header_only=kernels is None)
    job = Job(output, fmt, options, run, shards, kernels)
    try:
        plan = plan_headers(shards.headers(), options, fmt)
        if run.mode is Mode.WRITE:
            from qtool.engine import write

            done = (
                write.write_files(job, plan)
                if output.model is None
                else write.write_model(job, plan)
            )
        else:
            preflight(run.also, output.source.protected, force=run.force)
            done = (
                _estimate(job, plan) if kernels else Done(plan, list(map(planned_row, plan.plans)))
            )
        return _summary(job, done, started)
    finally:
        shards.close()


def _output(src: Path, out: Path | None, options: QuantizeOptions) -> Output:
    """qtool's output: a file and its sidecar beside `src` (or `out`), or for a sharded
    checkpoint a directory of them. Other formats write a model directory, named by `out`."""
    if options.format is not FormatName.QTOOL:
        return _model_output(src, out, options)
    source = open_source(src)
    dtype = output_tag(options)
    if source.index is None:
        out = quantized_output(src, out, dtype)
    else:
        refuse_file_name_for_directory(out, "quantize")
    return Output(source, target_for(source, out, default_quantized_path(src, dtype), dtype))


def _model_output(src: Path, out: Path | None, options: QuantizeOptions) -> Output:
    if out is None:
        raise UsageError(
            None, f"--format {options.format.value} writes a model directory: name it with -o"
        )
    model = open_model(src, options.config)
    return Output(model.source, model_target(model, out), model)


def _format(options: QuantizeOptions, output: Output) -> OutputFormat:
    if output.model is None:
        return output_format(options.format)
    context = FormatContext(output.model.config, options.group_fallback, output.model.config_dir)
    return output_format(options.format, context)


def _kernels(run: RunOptions, fmt: OutputFormat) -> Kernels:
    from qtool.engine.loop import Kernels, resolve_device

    return Kernels(resolve_device(run.device), run.progress, fmt.scales_in_weight_dtype)


def _estimate(job: Job, plan: ModelPlan) -> Done:
    """The rows a real run would report, error figures included, without writing anything."""
    from qtool.engine.budget import data_passes
    from qtool.engine.loop import estimate_rows

    assert job.kernels is not None
    with data_passes(job, plan, None) as (plan, spill):
        job.kernels.expect(plan.plans)
        rows: list[QuantizeRow] = []
        for shard, plans in plan.per_shard():
            rows += estimate_rows(job.shards.checkpoint(shard), plans, job.kernels, spill)
            job.shards.done(shard)
    return Done(plan, rows)


def _summary(job: Job, done: Done, started: float) -> QuantizeSummary:
    """The run's summary: its rows, what it read and wrote, and the format's warnings (after
    the writing, which may add some) and its list of tensors kept in float."""
    target, plans = job.output.target, done.plan.plans
    named = target.named if target.directory else job.fmt.layout(target.shard_outputs[0])
    return QuantizeSummary(
        inputs=[str(job.output.source.path)],
        outputs=[str(p) for p in named],
        rows=done.rows,
        spec=job.options.spec,
        device="none" if job.kernels is None else str(job.kernels.device),
        dry_run=job.run.mode is not Mode.WRITE,
        skipped=job.shards.skipped,
        stale_temps_removed=done.stale_temps_removed,
        seconds=time.perf_counter() - started,
        notes=[*done.notes, *job.fmt.warnings(plans)],
        budget_sizes=_budget_sizes(job, plans),
        format=job.fmt.name,
        ignore=job.fmt.ignore(plans),
    )


def _budget_sizes(job: Job, plans: Sequence[TensorPlan]) -> tuple[int, int] | None:
    """With --target-sqnr: the output size had the budget's tensors all been int8 (sym, per
    channel, min-max), and had they all stayed float."""
    if job.options.target_sqnr is None:
        return None
    from qtool.engine.budget import budget_sizes

    return budget_sizes(plans, job.fmt)
