"""The quantize loop: one for single files and sharded checkpoints alike (a file is a one-shard
source), feeding any output format through its writer.

One tensor at a time: read (zero-copy) -> quantize and measure -> hand to the format's writer,
then the next; nothing holds the whole checkpoint. Everything is planned and validated before
the first output byte is written, and outputs appear only complete (atomic.OutputSet). Knows
nothing of Rich or Typer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from qtool.engine import batch
from qtool.engine.model_dir import (
    ModelInput,
    building,
    check_output_dir,
    companions,
    finish_model_directory,
    model_target,
    open_model,
)
from qtool.engine.plan import (
    QuantizeOptions,
    TensorPlan,
    default_quantized_path,
    plan_tensors,
    planned_row,
    quantized_output,
)
from qtool.engine.source import (
    Source,
    Target,
    finish_directory,
    open_source,
    prepared,
    target_for,
)
from qtool.engine.spill import Figures, Spill
from qtool.errors import DeviceError, NumericError, OutputError, UsageError
from qtool.formats import output_format
from qtool.formats.base import Choice, FormatContext, OutputFormat, ShardWriter
from qtool.formats.detect import refuse_quantized
from qtool.formats.qtool import sidecar_path
from qtool.io.atomic import (
    OutputSet,
    preflight,
    refuse_file_name_for_directory,
    remove_stale_temps,
)
from qtool.io.checkpoint import Checkpoint, open_checkpoint
from qtool.io.stformat import TensorEntry, read_header
from qtool.numerics import budget, kernels, select
from qtool.numerics.ranges import NonFiniteInput
from qtool.results import Progress, QuantizeSummary, TensorRow
from qtool.spec import INT8_CHANNEL, QSpec, fit_spec

BACKGROUND_MIN_BYTES = 1 << 20  # smaller tensors are written inline


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
class Run:
    """How a run goes: where the kernels run, what it writes over, what it reports to, and
    whether scales are rounded to the weight's dtype before the codes are computed."""

    device: torch.device
    force: bool = False
    progress: Progress | None = None
    scales_in_weight_dtype: bool = False


def quantize_model(
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
    """Export a model to a format whose output is a model directory (compressed-tensors):
    the same loop, planned from headers first; the directory is built under a temporary name
    and appears complete or not at all."""
    started = time.perf_counter()
    if out is None:
        raise UsageError(
            None, f"--format {options.format} writes a model directory: name it with -o"
        )
    model = open_model(src, options.config)
    context = FormatContext(model.config, options.group_fallback)
    fmt = output_format(options.format, context)
    run = Run(resolve_device(device), force, progress, fmt.scales_in_weight_dtype)
    shards = _Shards(model.source, options, fmt)
    try:
        plans = shards.plans()
        summary = _Summary(
            model.source, model_target(model, out), fmt, options, run, started, shards
        )
        if dry_run:
            preflight(also, model.source.protected, force=force)
            shards.decide_budget(run, None)
            rows = _estimate(shards, run) if estimate else [planned_row(p) for p in plans]
            return _with_format(summary.of(rows, dry_run=True), fmt, shards.plans_now(), [])
        check_output_dir(out, model, force)
        preflight(also, model.source.protected, force=force)
        notes = companions(model)[1]
        with building(out) as temp:
            target = model_target(model, temp)
            needed = _needed_bytes(plans, options)
            preflight(list(target.shard_outputs), [], force=False, needed_bytes=needed)
            shards.decide_budget(run, temp.parent)
            finish = _finish_model(model, temp, fmt, shards)
            rows = _write(shards, target, fmt, run, finish)
        return _with_format(summary.of(rows), fmt, shards.plans(), notes)
    finally:
        shards.close()


def _with_format(
    summary: QuantizeSummary, fmt: OutputFormat, plans: list[TensorPlan], notes: list[str]
) -> QuantizeSummary:
    """The summary with the format's warnings (one line each) and its ignore list."""
    warnings = fmt.warnings(plans)
    return replace(summary, notes=[*notes, *warnings], format=fmt.name, ignore=fmt.ignore(plans))


def _finish_model(model: ModelInput, directory: Path, fmt: OutputFormat, shards: _Shards) -> Finish:
    """A model directory's last files: the format's own (config.json), the companions, and
    the index with the names the format stores each tensor under."""

    def finish(outputs: OutputSet, weight_map: dict[str, str], total: int) -> None:
        files = fmt.directory_files(shards.plans())
        finish_model_directory(outputs, model, directory, files, weight_map, total)

    return finish


def quantize(
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
    """Quantize a checkpoint file or a sharded checkpoint. A dry run only plans (from headers);
    with `estimate` it also measures the error, and writes nothing either way. `also`: files the
    caller writes afterwards (a plot), checked with the run's outputs."""
    if options.format != "qtool":
        return quantize_model(
            src, out, options, device=device, force=force, dry_run=dry_run,
            estimate=estimate, progress=progress, also=also,
        )  # fmt: skip
    started = time.perf_counter()
    run = Run(resolve_device(device), force, progress)
    source = open_source(src)
    dtype = options.spec.dtype.value
    if source.index is None:
        out = quantized_output(src, out, dtype)
    else:
        refuse_file_name_for_directory(out, "quantize")
    target = target_for(source, out, default_quantized_path(src, dtype), dtype)
    writer_format = output_format(options.format)
    shards = _Shards(source, options, writer_format)
    try:
        plans = shards.plans()
        summary = _Summary(source, target, writer_format, options, run, started, shards)
        if dry_run:
            preflight(also, source.protected, force=force)
            shards.decide_budget(run, None)
            rows = _estimate(shards, run) if estimate else [planned_row(p) for p in plans]
            return summary.of(rows, dry_run=True)
        needed = _needed_bytes(plans, options)
        for out_file in target.shard_outputs:
            _check_recordable_name(out_file)
        with prepared(source, target, writer_format.layout, force, also, needed) as notes:
            directory = target.directory or target.shard_outputs[0].parent
            stale = remove_stale_temps(directory)
            shards.decide_budget(run, directory)
            rows = _write(shards, target, writer_format, run)
        return replace(summary.of(rows), stale_temps_removed=stale, notes=notes)
    finally:
        shards.close()


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


class _Shards:
    """The shards of a source, planned from their headers first and opened one at a time
    (a torch pickle must be loaded to be planned; it is loaded once)."""

    def __init__(self, source: Source, options: QuantizeOptions, fmt: OutputFormat) -> None:
        self.source, self.options, self.fmt = source, options, fmt
        self._open: dict[Path, Checkpoint] = {}
        self._plans: dict[Path, list[TensorPlan]] = {}
        self.skipped: list[str] = []
        self.spill: Spill | None = None

    def plans(self) -> list[TensorPlan]:
        """Every tensor's plan, in shard order: the rules' (from the headers), narrowed by the
        format (planned once)."""
        if not self._plans:
            for shard in self.source.shards:
                entries, metadata = self._entries(shard)
                refuse_quantized(shard, metadata, [e.name for e in entries])
                self._plans[shard] = plan_tensors(shard, entries, self.options)
            self._format_selection()
        return self.plans_now()

    def decide_budget(self, run: Run, spill_directory: Path | None) -> None:
        """With an error budget, its choices (see _apply_budget), their codes kept in a
        temporary file in `spill_directory` for the writing pass (None: a dry run, which keeps
        only their figures)."""
        if self.options.target_sqnr is not None:
            _expect(self, run)
            self.spill = Spill(spill_directory)
            self._apply_budget(run, self.options.target_sqnr, _ladder(self.options))

    def plans_now(self) -> list[TensorPlan]:
        """The plans as they stand (after the budget, if any), in shard and file order."""
        return [p for shard in self.source.shards for p in self._plans[shard]]

    def _format_selection(self) -> None:
        """The format's own narrowing over the whole model, where it has one."""
        choices = self.fmt.select(self.plans_now())
        if choices is None:
            return
        it = iter(choices)
        for shard in self.source.shards:
            self._plans[shard] = [_chosen(p, next(it)) for p in self._plans[shard]]

    def _apply_budget(self, run: Run, target: float, ladder: Sequence[QSpec]) -> None:
        """Choose the spec of every tensor the budget decides (one in-memory pass per tensor,
        the format's fused siblings aligned); the checkpoints stay open for the writing pass."""
        for shard in self.source.shards:
            ckpt = self._checkpoint(shard)
            workspace = kernels.Workspace(run.device)
            self._plans[shard] = [
                self._choose(ckpt, p, ladder, target, workspace, run) if p.budget else p
                for p in self._plans[shard]
            ]
        aligned = iter(align_fused(self.plans_now(), self.fmt.fused_key))
        for shard in self.source.shards:
            self._plans[shard] = [next(aligned) for _ in self._plans[shard]]
        self._format_selection()

    def _choose(
        self,
        ckpt: Checkpoint,
        plan: TensorPlan,
        ladder: Sequence[QSpec],
        target: float,
        workspace: kernels.Workspace,
        run: Run,
    ) -> TensorPlan:
        entry = plan.entry
        refusals = {s: self.fmt.supports(entry, s) for s in budget.candidates(ladder, entry.shape)}
        fitting = [s for s, refused in refusals.items() if refused is None]
        if not fitting:
            why = next(iter(refusals.values()), None)
            return plan.kept(f"kept float: no ladder spec fits {self.fmt.name} ({why})")
        keep_nan = self.options.keep_nonfinite
        weight_dtype = run.scales_in_weight_dtype
        return choose_plan(
            ckpt, plan, fitting, target, workspace, keep_nan, weight_dtype, self.spill
        )

    def checkpoint_plans(self, shard: Path) -> tuple[Checkpoint, list[TensorPlan]]:
        ckpt = self._checkpoint(shard)
        plans = self._plans[shard]
        if self.options.keep_nonfinite:
            plans = keep_nonfinite(ckpt, plans)
            self._plans[shard] = plans  # what was written: a format's files describe it
        return ckpt, plans

    def done(self, shard: Path) -> None:
        ckpt = self._open.pop(shard, None)
        if ckpt is not None:
            self.skipped += ckpt.skipped
            ckpt.close()

    def close(self) -> None:
        for shard in list(self._open):
            self.done(shard)
        if self.spill is not None:
            self.spill.close()

    @property
    def skipped_entries(self) -> list[str]:
        """Non-tensor entries of the pickles read so far (and still open)."""
        return self.skipped + [s for ckpt in self._open.values() for s in ckpt.skipped]

    def _entries(self, shard: Path) -> tuple[tuple[TensorEntry, ...], dict[str, str] | None]:
        if self.source.index is not None:  # shards are safetensors, validated with the index
            header = read_header(shard)
            return header.tensors, header.metadata
        ckpt = self._checkpoint(shard)
        return ckpt.entries, ckpt.metadata

    def _checkpoint(self, shard: Path) -> Checkpoint:
        if shard not in self._open:
            self._open[shard] = open_checkpoint(shard)
        return self._open[shard]


def _estimate(shards: _Shards, run: Run) -> list[TensorRow]:
    """The rows a real run would report, error figures included, without writing anything."""
    _expect(shards, run)
    rows: list[TensorRow] = []
    for shard in shards.source.shards:
        ckpt, plans = shards.checkpoint_plans(shard)
        rows += estimate_rows(ckpt, plans, run, shards.spill)
        shards.done(shard)
    return rows


def _expect(shards: _Shards, run: Run) -> None:
    """Tell the kernel choice how much this run quantizes (numerics/select.py)."""
    select.expect(run.device, sum(p.entry.nbytes for p in shards.plans() if p.spec is not None))


Finish = Callable[[OutputSet, dict[str, str], int], None]
"""Writes a run's last files given the output index's weight map and total size."""


def _write(
    shards: _Shards, target: Target, fmt: OutputFormat, run: Run, finish: Finish | None = None
) -> list[TensorRow]:
    """Every shard through the format's writer, then `finish` (default: for a sharded output,
    the companions and the index)."""
    _expect(shards, run)
    if run.progress is not None:
        run.progress.start(sum(p.entry.nbytes for p in shards.plans_now()))
    rows: list[TensorRow] = []
    weight_map: dict[str, str] = {}
    with OutputSet() as outputs:
        for shard, out in zip(shards.source.shards, target.shard_outputs, strict=True):
            ckpt, plans = shards.checkpoint_plans(shard)
            writer = fmt.writer(plans, ckpt.metadata, out, outputs)
            rows += write_shard(ckpt, plans, writer, run, shards.spill)
            weight_map |= {n: out.name for p in plans for n in fmt.tensor_names(p)}
            shards.done(shard)
        total = sum(r.bytes_out for r in rows)
        if finish is None:
            section = _index_section(shards, target)
            finish_directory(outputs, shards.source, target, total, section)
        else:
            finish(outputs, weight_map, total)
        outputs.commit()
    return rows


def _index_section(shards: _Shards, target: Target) -> dict[str, object]:
    sidecars = {out.name: sidecar_path(out).name for out in target.shard_outputs}
    return {"format": "qtool.sharded", "format_version": 1, "sidecars": sidecars}


def write_shard(
    ckpt: Checkpoint,
    plans: list[TensorPlan],
    writer: ShardWriter,
    run: Run,
    spill: Spill | None = None,
) -> list[TensorRow]:
    """Stream one shard's tensors to the writer in the order it takes them; rows in file order.
    A tensor the error budget already quantized comes from `spill`, not from the input.

    Tensor k is handed to the writer by a background thread while tensor k+1 is quantized (the
    write syscalls and the torch kernels both release the GIL)."""
    by_name = {p.entry.name: p for p in plans}
    rows: dict[str, TensorRow] = {}
    order = [by_name[entry.name] for entry in writer.order]
    with _BackgroundWriter(ckpt) as background:
        for plan, done in _results(ckpt, order, run, spill=spill):
            entry = plan.entry
            if done is None:
                background.submit(entry, writer.keep, entry, ckpt.raw(entry))
                rows[entry.name] = planned_row(plan)
            else:
                background.submit(entry, writer.quantized, entry, plan.spec, done.result)
                rows[entry.name] = _measured_row(plan, done.figures)
            if run.progress is not None:
                run.progress.advance(entry.name, entry.nbytes)
    ckpt.check_unchanged()
    writer.finish()
    return [rows[p.entry.name] for p in plans]


def _results(
    ckpt: Checkpoint,
    order: list[TensorPlan],
    run: Run,
    *,
    spill: Spill | None = None,
    skip: Collection[str] = (),
) -> Iterator[tuple[TensorPlan, batch.Quantized | None]]:
    """Each plan in `order` with its result (None: kept as it is, or named in `skip`). A tensor
    the error budget already quantized comes from `spill`; tiny tensors are quantized a batch
    at a time (engine/batch.py), the others one by one in two alternating workspaces, so the
    codes being written are never the ones being computed."""
    workspaces = (kernels.Workspace(run.device), kernels.Workspace(run.device))
    tiny = batch.TinyBatches(ckpt, order, run.device, run.scales_in_weight_dtype)
    for k, plan in enumerate(order):
        if plan.spec is None or plan.entry.name in skip:
            yield plan, None
            continue
        result = spill.take(plan.entry.name, plan.spec) if spill is not None else None
        done = tiny.take(k) if result is None else None
        if done is None:
            if result is None:
                result = _quantize_one(ckpt, plan, workspaces[k % 2], run.scales_in_weight_dtype)
            done = batch.Quantized(result, (float(result.scale.min()), float(result.scale.max())))
        yield plan, done


class _BackgroundWriter:
    """At most one write in flight: `submit` waits for the previous one, then hands this one
    to a worker thread; leaving the context waits for the last (and re-raises its error)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self._ckpt = ckpt
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qtool-write")
        self._pending: Future[None] | None = None

    def __enter__(self) -> _BackgroundWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._wait()
        finally:
            self._pool.shutdown(wait=True)

    def submit(self, entry: TensorEntry, write: object, *args: object) -> None:
        self._wait()
        if entry.nbytes < BACKGROUND_MIN_BYTES:
            self._write(entry, write, args)  # a thread hand-off costs more than a small write
        else:
            self._pending = self._pool.submit(self._write, entry, write, args)

    def _write(self, entry: TensorEntry, write: object, args: tuple[object, ...]) -> None:
        write(*args)  # type: ignore[operator]
        self._ckpt.release(entry)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


def estimate_rows(
    ckpt: Checkpoint, plans: list[TensorPlan], run: Run, spill: Spill | None = None
) -> list[TensorRow]:
    """The rows a real run would report, error figures included, without writing anything
    (the figures of the tensors the error budget measured come from `spill`)."""
    known = {}
    if spill is not None:
        for p in plans:
            found = spill.figures(p.entry.name, p.spec) if p.spec is not None else None
            if found is not None:
                known[p.entry.name] = found
    rows = []
    for plan, done in _results(ckpt, plans, run, skip=known.keys()):
        if plan.entry.name in known:
            rows.append(_measured_row(plan, known[plan.entry.name]))
        else:
            rows.append(planned_row(plan) if done is None else _measured_row(plan, done.figures))
            ckpt.release(plan.entry)
    return rows


def _quantize_one(
    ckpt: Checkpoint, plan: TensorPlan, workspace: kernels.Workspace, weight_dtype: bool = False
) -> kernels.QuantizedTensor:
    assert plan.spec is not None
    x = ckpt.tensor(plan.entry).to(workspace.device)
    scale_dtype = x.dtype if weight_dtype else torch.float32
    try:
        return select.quantize_tensor(x, plan.spec, workspace=workspace, scale_dtype=scale_dtype)
    except NonFiniteInput as err:
        if err.count == 0:  # finite float64 values whose float32 range overflows
            raise NumericError(
                ckpt.path,
                f"holds {plan.entry.dtype} values beyond float32's range (largest magnitude "
                f"{float(x.abs().max()):.3g}), which cannot be quantized in float32; "
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
    except kernels.GridOverflow as err:
        raise NumericError(ckpt.path, str(err), plan.entry.name, hint="exclude") from None
    except ValueError as err:
        raise NumericError(ckpt.path, str(err), plan.entry.name) from None


def _ladder(options: QuantizeOptions) -> tuple[QSpec, ...]:
    recipe = options.recipe
    return recipe.ladder if recipe is not None and recipe.ladder else budget.DEFAULT_LADDER


def choose_plan(
    ckpt: Checkpoint,
    plan: TensorPlan,
    ladder: Sequence[QSpec],
    target: float,
    workspace: kernels.Workspace,
    keep_nan: bool,
    weight_dtype: bool = False,
    spill: Spill | None = None,
) -> TensorPlan:
    """The plan with the budget's choice: the cheapest ladder spec reaching `target`, or kept
    in float; NaN/Inf tensors are left to --keep-nonfinite (or fail as in a plain run).
    `weight_dtype`: scales rounded to the weight's dtype, as the format stores them; `spill`
    keeps the chosen quantization for the writing pass."""
    x = ckpt.tensor(plan.entry).to(workspace.device)
    scale_dtype = x.dtype if weight_dtype else torch.float32
    try:
        choice = budget.choose(x, ladder, target, scale_dtype=scale_dtype, workspace=workspace)
    except NonFiniteInput:
        if keep_nan and (kept := _nonfinite_kept(plan, x)) is not None:
            return kept
        _quantize_one(ckpt, plan, workspace)  # raises the run's own NumericError
        raise
    finally:
        ckpt.release(plan.entry)
    if choice.spec is None:
        return replace(plan, spec=None, reason=choice.reason(), note="", asked=None)
    if spill is not None and choice.result is not None:
        spill.put(plan.entry.name, choice.spec, choice.result)
    return replace(plan, spec=choice.spec, note=choice.reason(), asked=None)


def align_fused(plans: Sequence[TensorPlan], key: Callable[[str], str | None]) -> list[TensorPlan]:
    """The plans with each set of fused siblings (same `key`) quantized alike: the budget's
    tensors take the spec of a sibling a rule fixed, else the dearest of their own choices
    (kept float is dearest), so that every member still meets the target as far as the
    ladder is ordered by quality. A member moved off its own choice says so in its note."""
    sets: dict[str, list[int]] = {}
    for i, p in enumerate(plans):
        k = key(p.entry.name)
        if k is not None:
            sets.setdefault(k, []).append(i)
    out = list(plans)
    for k, members in sets.items():
        chosen = [plans[i] for i in members if plans[i].budget]
        if not chosen or len({p.spec for p in (plans[i] for i in members)}) == 1:
            continue
        fixed = [plans[i] for i in members if not plans[i].budget]
        pick = fixed[0] if fixed else max(chosen, key=_dearness)
        for i in members:
            if plans[i].budget and plans[i].spec != pick.spec:
                out[i] = _aligned(plans[i], pick, k)
    return out


def _dearness(plan: TensorPlan) -> float:
    """Order of the budget's choices: bytes per element, kept float last."""
    if plan.spec is None:
        return math.inf
    return budget.bytes_per_tensor(plan.spec, plan.entry.shape) / plan.entry.numel


def _aligned(plan: TensorPlan, pick: TensorPlan, key: str) -> TensorPlan:
    own = plan.note or plan.reason
    why = f"aligned with its fused siblings {key}; own choice {own}"
    if pick.spec is None:
        return replace(plan.kept(f"kept float: {why}"), budget=True, asked=None)
    return replace(plan, spec=pick.spec, note=why, asked=None)


def _chosen(plan: TensorPlan, choice: Choice) -> TensorPlan:
    """A plan with the format's decision (its spec, and what it stores)."""
    newly_kept = plan.spec is not None and choice.spec is None
    return replace(
        plan,
        spec=choice.spec,
        reason=choice.reason,
        note=choice.note,
        stored_nbytes=choice.nbytes,
        stored_dtype=choice.stored_dtype,
        budget=plan.budget and not newly_kept,
    )


def keep_nonfinite(ckpt: Checkpoint, plans: list[TensorPlan]) -> list[TensorPlan]:
    """Turn plans whose tensor holds NaN/Inf into pass-throughs (one extra read of each; the
    error budget's tensors were checked when it measured them)."""
    out = []
    for plan in plans:
        if plan.spec is not None and not plan.budget:
            x = ckpt.tensor(plan.entry)
            lo, hi = torch.aminmax(x)  # no full-size temporaries; NaN/Inf show up here
            if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
                plan = _nonfinite_kept(plan, x) or plan
            ckpt.release(plan.entry)
        out.append(plan)
    return out


def _nonfinite_kept(plan: TensorPlan, x: torch.Tensor) -> TensorPlan | None:
    """The plan kept as it is for the NaN/Inf values `x` holds (None: it holds none)."""
    bad = int((~torch.isfinite(x)).sum())
    if not bad:
        return None
    return replace(plan.kept(f"{bad} NaN/Inf values (--keep-nonfinite)"), budget=False)


def _measured_row(plan: TensorPlan, figures: Figures) -> TensorRow:
    return planned_row(plan, figures.errors, figures.scale_range)


def _needed_bytes(plans: Sequence[TensorPlan], options: QuantizeOptions) -> int:
    """Free space to ask for: the outputs, each tensor the error budget decides counted at the
    most it can take (kept float, or its dearest candidate) plus its dearest candidate again
    (its codes kept between the two passes)."""
    ladder = _ladder(options)
    total = 0
    for p in plans:
        if p.budget:
            dearest = max(budget.bytes_per_tensor(s, p.entry.shape) for s in ladder)
            total += max(p.entry.nbytes, dearest) + dearest
        else:
            total += p.out_nbytes
    return total


@dataclass(frozen=True)
class _Summary:
    """What the summary of this run says besides its rows."""

    source: Source
    target: Target
    fmt: OutputFormat
    options: QuantizeOptions
    run: Run
    started: float
    shards: _Shards

    def of(self, rows: list[TensorRow], dry_run: bool = False) -> QuantizeSummary:
        outputs = self.target.named
        if self.target.directory is None:
            outputs = self.fmt.layout(self.target.shard_outputs[0])
        return QuantizeSummary(
            inputs=[str(self.source.path)],
            outputs=[str(p) for p in outputs],
            rows=rows,
            spec=self.options.spec,
            device=str(self.run.device),
            dry_run=dry_run,
            skipped=self.shards.skipped_entries,
            seconds=time.perf_counter() - self.started,
            budget_sizes=self._budget_sizes(),
        )

    def _budget_sizes(self) -> tuple[int, int] | None:
        """With --target-sqnr: the output size had the budget's tensors all been int8 (sym,
        per channel, min-max), and had they all stayed float."""
        if self.options.target_sqnr is None:
            return None

        return self._size_if(INT8_CHANNEL), self._size_if(None)

    def _size_if(self, spec: QSpec | None) -> int:
        """The output size (codes and qparams) had every tensor the budget decided been
        quantized with `spec` (None: kept), as the format stores it."""
        total = 0
        for plan in self.shards.plans_now():
            if plan.budget:
                fitted = fit_spec(spec, plan.entry.shape)[0] if spec is not None else None
                plan = TensorPlan(plan.entry, fitted)
                stored = self.fmt.stored_nbytes(plan.entry, fitted)
                if stored is not None:
                    total += stored
                    continue
            total += plan.out_nbytes + plan.qparam_nbytes
        return total
