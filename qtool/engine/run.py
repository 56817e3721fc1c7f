"""`quantize`: one function for every input and output, in one of three modes (job.Mode).

A lone file is a one-shard source, a checkpoint directory (sharded, or a model directory with
one weight file) its shards; the output is what the format writes (qtool: a file and its
sidecar per shard, in a directory that mirrors an input directory; compressed-tensors: a model
directory), laid out by engine/layout.py. Every run plans from the headers first
(engine/plan.py, passes 1-3); a PLAN stops there, an ESTIMATE reads and measures (passes 4-7,
then the loop without a writer), a WRITE checks its outputs, then does the same with the
format's writer (`_write`).

Torch-free at import: the modules that need torch are imported when the mode needs them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.calibration import Role, TextUse
from qtool.engine.decision import TensorPlan
from qtool.engine.importance import Provenance, match_importance, read_importance
from qtool.engine.job import Done, Job, Mode, RunOptions
from qtool.engine.layout import (
    Target,
    check_outputs,
    default_directory,
    directory_target,
    file_target,
    finish_directory,
    prepared,
    refuse_file_name,
)
from qtool.engine.plan import (
    ModelPlan,
    QuantizeOptions,
    output_tag,
    plan_headers,
    planned_row,
    quantized_output,
    tied_notes,
    tied_warnings,
)
from qtool.engine.shards import Shards
from qtool.engine.source import Source, open_source
from qtool.engine.tied import tied_embeddings
from qtool.errors import InputError, RecipeError, UsageError
from qtool.formats.base import FormatContext, OutputFormat
from qtool.formats.registry import entry, input_refusal, output_format, refuses
from qtool.io.atomic import OutputSet
from qtool.io.jsonfile import read_json_object
from qtool.io.stformat import TensorEntry
from qtool.numerics.imatrix import ImportanceMatrix
from qtool.results import AllocationPlan, QuantizeRow, QuantizeSummary

if TYPE_CHECKING:
    from qtool.engine.loop import Kernels
    from qtool.engine.spill import Spill


def quantize(
    src: Path,
    out: Path | None,
    options: QuantizeOptions,
    run: RunOptions,
    *,
    requantize: bool = False,
) -> QuantizeSummary:
    """Quantize `src` into `out`, or only plan it, or estimate it (see Mode); `requantize`:
    an already quantized GGUF is taken as float (engine/requantize.py's dry run)."""
    started = time.perf_counter()
    if run.mode is Mode.PLAN and options.budgeted:
        raise UsageError(
            None,
            "the error budget measures each tensor, which a plan from headers does not",
            hint="estimate",
        )
    source = open_source(src, options.config, requantize=requantize)
    imatrix = read_importance(options.imatrix) if options.imatrix is not None else None
    weighing = imatrix if options.imatrix_weighs_codes else None  # the outputs record only it
    fmt = _format(options, source, weighing[1].as_dict() if weighing is not None else None)
    _check_ladder(options)
    target = _target(source, src, out, options, fmt)
    threads = ExitStack()  # torch's count given back to an in-process caller at the end
    kernels = None if run.mode is Mode.PLAN else _kernels(run, fmt, threads)
    shards = Shards(source, header_only=kernels is None)
    job = Job(source, target, fmt, options, run, shards, kernels)
    try:
        headers = list(shards.headers())
        tied = _tied(source, headers)
        plan = plan_headers(headers, options, fmt, tied)
        _check_type_names(plan, options, fmt)
        if imatrix is not None:
            job = _with_importance(job, imatrix, headers, plan)
            plan = replace(plan, texts=_imatrix_texts(imatrix[1]))
        if run.mode is Mode.WRITE:
            done = _write(job, plan)
        else:
            _check_as_written(job, plan)
            done = (
                _estimate(job, plan) if kernels else Done(plan, list(map(planned_row, plan.plans)))
            )
        return _summary(job, done, started, tied)
    finally:
        shards.close()
        threads.close()


def _check_ladder(options: QuantizeOptions) -> None:
    """A recipe's ladder holds only specs the output format stores (RecipeError, before any
    work): a budget or an allocation over one it does not fails only when it writes."""
    recipe = options.recipe
    if not options.budgeted or recipe is None or not recipe.ladder:
        return
    for spec in recipe.ladder:
        if (why := refuses(options.format.value, spec)) is not None:
            raise RecipeError(Path(recipe.path), f"ladder: {why}")


def _check_type_names(plan: ModelPlan, options: QuantizeOptions, fmt: OutputFormat) -> None:
    """A tensor-type file names each tensor the allocation decides: one whose name it cannot
    express (non-ASCII, NUL) is refused before any work."""
    if options.save_tensor_types is None:
        return
    from qtool.engine.allocate import inexpressible_name

    name = inexpressible_name(plan.plans, fmt)
    if name is not None:
        raise UsageError(
            options.save_tensor_types,
            f"llama-quantize's tensor-type file cannot name the tensor {name!r} (it reads "
            "ASCII names without NUL); write the plan as a recipe instead",
        )


def _format(
    options: QuantizeOptions, source: Source, imatrix: dict[str, object] | None = None
) -> OutputFormat:
    """The output format, set up with the model's config.json (read through the directory),
    the files it reads and the provenance of an importance matrix; UsageError for an input the
    format does not quantize (GGUF in, GGUF out)."""
    refused = input_refusal(options.format.value, source.found)
    if refused is not None:
        raise UsageError(source.path, refused, hint="format")
    context = FormatContext(
        source.config,
        options.group_fallback,
        source.config_dir,
        source.within,
        tuple(source.shards),
        imatrix,
    )
    fmt = output_format(options.format, context)
    if fmt.model_directory and not all(s.name.endswith(".safetensors") for s in source.shards):
        raise InputError(source.path, f"a {fmt.name} export reads .safetensors checkpoints only")
    return fmt


def _target(
    source: Source, src: Path, out: Path | None, options: QuantizeOptions, fmt: OutputFormat
) -> Target:
    """A model directory for a format that writes one (named by `out`); else qtool's file and
    sidecar beside `src` (or `out`), or for a checkpoint directory a directory of them."""
    if fmt.model_directory:
        if out is None:
            raise UsageError(None, f"--format {fmt.name} writes a model directory: name it with -o")
        return directory_target(source, out)
    label = output_label(options)
    if source.directory is None:
        return file_target(quantized_output(src, out, label, entry(fmt.name).suffix))
    refuse_file_name(out, "quantize")
    return directory_target(source, out or default_directory(source, label))


def output_label(options: QuantizeOptions) -> str:
    """What a default output name says of the run: the dtype ('int8'), a whole codec's name
    ('Q4_K'), or 'mixed' for a run whose error budget chooses among the codecs the format stores
    (a GGUF run's types)."""
    spec = options.spec
    if spec.whole:
        return spec.tag
    if spec.kind not in entry(options.format.value).codecs:
        return "mixed"
    return output_tag(options)


def _check_as_written(job: Job, plan: ModelPlan) -> None:
    """A run that writes nothing makes every check a real run makes before it reads a tensor:
    its outputs (their directory exists and is writable, nothing is replaced without --force,
    the free space) and, for a plan, the device (torch is imported only for a named GPU)."""
    run = job.run
    if job.kernels is None and run.device not in ("auto", "cpu"):
        from qtool.engine.loop import resolve_device

        resolve_device(run.device)
    if job.options.budgeted:
        from qtool.engine.budget import needed_bytes

        needed = needed_bytes(plan.plans, job.options)
    else:
        needed = sum(p.out_nbytes for p in plan.plans)
    check_outputs(
        job.source, job.target, job.fmt.layout, run.force, run.also, needed,
        protect=job.options.input_files,
    )  # fmt: skip


def _kernels(run: RunOptions, fmt: OutputFormat, threads: ExitStack) -> Kernels:
    from qtool.engine.loop import Kernels, resolve_device
    from qtool.engine.threads import using_threads

    # here, not in the CLI: a usage error never waits for torch; None: the idle cores
    threads.enter_context(using_threads(run.threads))
    return Kernels(resolve_device(run.device), run.progress, fmt.scales_in_weight_dtype)


Finish = Callable[[OutputSet, dict[str, str], int], None]
"""Writes a run's last files given the output index's weight map and total size."""


def _write(job: Job, plan: ModelPlan) -> Done:
    """Every output of the run, for every format and layout: checked first, then the data
    passes, the shards, and (a directory output) the format's files, the companions and the
    index with the names the format stores each tensor under."""
    from qtool.engine.budget import data_passes, needed_bytes

    source, target, fmt, run = job.source, job.target, job.fmt, job.run
    needed, keep = needed_bytes(plan.plans, job.options), job.options.input_files
    with prepared(source, target, fmt.layout, run.force, run.also, needed, protect=keep) as place:
        placed = place.target
        with data_passes(job, plan, place.scratch) as (final, spill):
            fmt = fmt.with_texts(final.texts)  # a method's texts are known after its pass
            job = replace(job, fmt=fmt)

            def finish(outputs: OutputSet, weight_map: dict[str, str], total: int) -> None:
                if placed.directory is None:
                    return
                files = fmt.directory_files(final.plans)
                section = fmt.index_section(placed.shard_outputs)
                finish_directory(outputs, source, place, files, weight_map, total, section)

            rows = _write_shards(job, final, placed, spill, finish)
    _save_plan(job, final)  # once the outputs are in place: never a plan of a failed run
    return Done(final, rows, place.notes, place.stale)


def _write_shards(
    job: Job, plan: ModelPlan, target: Target, spill: Spill | None, finish: Finish
) -> list[QuantizeRow]:
    """Every shard through the format's writer, then `finish`; committed only when all is."""
    from qtool.engine.loop import write_shard

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
    return Done(plan, rows)  # a dry run writes nothing, the plan files included


def _save_plan(job: Job, plan: ModelPlan) -> None:
    """An allocation's plan files (--save-recipe, --tensor-type-file), if asked for."""
    if job.options.allocation is not None:
        from qtool.engine.allocate import save_plan

        save_plan(plan.plans, job.options, job.fmt)


def _plan_files(job: Job) -> list[Path]:
    """The plan files the run writes (or, dry, would write): outputs like the model's."""
    options = job.options
    if options.allocation is None:
        return []
    return [p for p in (options.save_recipe, options.save_tensor_types) if p is not None]


def _tied(
    source: Source, headers: Sequence[tuple[Path, tuple[TensorEntry, ...]]]
) -> frozenset[str]:
    """The input embeddings that are also the output head (engine/tied.py), by the tensor
    names of every shard and the model's config.json when there is one."""
    names = [e.name for _, entries in headers for e in entries]
    return tied_embeddings(names, _model_config(source))


def _model_config(source: Source) -> dict[str, object] | None:
    """The model's config.json when there is one."""
    path, within = source.config, source.config_dir
    if path is not None and (within is None or within.exists(path.name)):
        return read_json_object(path, within=within, what="model config")
    return None


def _with_importance(
    job: Job,
    imatrix: tuple[ImportanceMatrix, Provenance],
    headers: Sequence[tuple[Path, tuple[TensorEntry, ...]]],
    plan: ModelPlan,
) -> Job:
    """The job with its importance matrix matched to the tensors (engine/importance.py); an
    entry that does not fit its tensor is refused naming both."""
    options = job.options
    assert options.imatrix is not None
    names = [e.name for _, entries in headers for e in entries]
    config = _model_config(job.source)
    importance = match_importance(options.imatrix, imatrix, names, config, job.source.config)
    notes = tuple(importance.check(plan.plans))
    if job.kernels is None:
        return job
    kernels = replace(job.kernels, importance=importance, importance_notes=notes,
                      weighs_codes=options.imatrix_weighs_codes)  # fmt: skip
    return replace(job, kernels=kernels)


def _summary(job: Job, done: Done, started: float, tied: frozenset[str]) -> QuantizeSummary:
    """The run's summary: its rows, what it read and wrote, and the format's warnings (after
    the writing, which may add some) and its list of tensors kept in float."""
    target, plans, allocation = job.target, done.plan.plans, done.plan.allocation
    measured = allocation is not None and allocation.measured
    warnings = tied_warnings(plans, tied, measured)
    named = target.named if target.directory else job.fmt.layout(target.shard_outputs[0])
    return QuantizeSummary(
        inputs=[str(job.source.path)],
        outputs=[str(p) for p in [*named, *_plan_files(job)]],
        rows=done.rows,
        spec=job.options.spec,
        device="none" if job.kernels is None else str(job.kernels.device),
        dry_run=job.run.mode is not Mode.WRITE,
        skipped=job.shards.skipped,
        stale_temps_removed=done.stale_temps_removed,
        seconds=time.perf_counter() - started,
        notes=[
            *done.plan.notes,
            *done.notes,
            *warnings,
            *job.fmt.warnings(plans),
            *(job.kernels.notes(plans) if job.kernels else []),
        ],
        budget_sizes=_budget_sizes(job, plans),
        budget_reference=entry(job.fmt.name).budget_reference,
        format=job.fmt.name,
        ignore=job.fmt.ignore(plans),
        imatrix=_provenance(job),
        texts=done.plan.texts,
        model_kl=done.plan.model_kl,
        allocation=allocation,
        remarks=[
            *([] if allocation is None else [_allocation_line(job, allocation)]),
            *_plan_only(job),
            *tied_notes(plans, tied, measured),
        ],
    )


def _plan_only(job: Job) -> list[str]:
    kernels = job.kernels
    if kernels is None or kernels.importance is None or kernels.weighs_codes:
        return []
    return ["the imatrix chose each tensor's spec only: the codes are unweighted, those of a "
            "run without it (the table's weighted SQNR still weighs them by it)"]  # fmt: skip


def _allocation_line(job: Job, allocation: AllocationPlan) -> str:
    from qtool.engine.allocate import summary_line

    assert job.options.allocation is not None
    return summary_line(job.options.allocation, allocation)


def _imatrix_texts(provenance: Provenance) -> tuple[TextUse, ...]:
    """The texts an imatrix was computed on, as every output records them (calibration.py)."""
    return tuple(
        TextUse.of(d.name, d.sha256, d.tokens, Role.CALIBRATION) for d in provenance.datasets
    )


def _provenance(job: Job) -> dict[str, object] | None:
    kernels = job.kernels
    if kernels is None or kernels.importance is None:
        return None
    provenance = kernels.importance.provenance.as_dict()
    return provenance if kernels.weighs_codes else {**provenance, "use": "plan"}


def _budget_sizes(job: Job, plans: Sequence[TensorPlan]) -> tuple[int, int] | None:
    """With --target-sqnr: the output size had the budget's tensors all been int8 (sym, per
    channel, min-max), and had they all stayed float."""
    if not job.options.budgeted:
        return None
    from qtool.engine.budget import budget_sizes

    return budget_sizes(plans, job.fmt)
