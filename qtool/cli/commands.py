"""The `qtool` commands: each parses its options, calls qtool.api, and hands the result to the
report (tables or JSON). The program around them (entry point, signals, exit codes, error
mapping) is cli/app.py; the options are declared once in cli/options.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from qtool.cli.app import GATE_FAILED, Command, app, lazy_module, user_errors
from qtool.cli.options import (
    TABLE_MAX_ROWS,
    TRIMMED_ROWS,
    AllOpt,
    AxisOpt,
    ConfigOpt,
    DeviceOpt,
    DryRunOpt,
    DtypeOpt,
    EstimateOpt,
    ExcludeOpt,
    ForceOpt,
    FormatOpt,
    GroupFallbackOpt,
    GroupSizeOpt,
    IncludeOpt,
    InputArg,
    JsonOpt,
    KeepNonfiniteOpt,
    MaxMseOpt,
    MinOverallOpt,
    MinSqnrOpt,
    OutDtype,
    PerChannelOpt,
    PlotOpt,
    Pool,
    PoolOpt,
    QuantizeOutOpt,
    RangeOpt,
    RecipeOpt,
    SchemeOpt,
    SortOpt,
    TargetSqnrOpt,
    ThreadsOpt,
    TopOpt,
    build_spec,
    check_format_options,
    quantize_mode,
)
from qtool.spec import (
    Device,
    FormatName,
    GroupFallback,
    RangeMethod,
    Scheme,
    SpecPatch,
    StorageDtype,
)

if TYPE_CHECKING:
    from qtool import api
    from qtool.api import Mode, QuantizeOptions
    from qtool.gates import GateResult
    from qtool.recipe.rules import Recipe
    from qtool.report import console as report
    from qtool.report import json as documents
    from qtool.results import QuantizeRow, QuantizeSummary, Row
else:
    api = lazy_module("qtool.api")
    report = lazy_module("qtool.report.console")
    documents = lazy_module("qtool.report.json")

R = TypeVar("R", bound="Row")


@app.command(
    cls=Command,
    short_help="Quantize a checkpoint: codes, a qparams sidecar, an error table.",
    epilog="Example: qtool quantize model.safetensors --scheme asym --per-channel "
    "-o model.int8.safetensors",
)
def quantize(
    ctx: typer.Context,
    src: InputArg,
    out: QuantizeOutOpt = None,
    scheme: SchemeOpt = Scheme.SYM,
    dtype: DtypeOpt = StorageDtype.INT8,
    per_channel: PerChannelOpt = True,
    axis: AxisOpt = None,
    group_size: GroupSizeOpt = None,
    range_method: RangeOpt = RangeMethod.MINMAX,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    recipe: RecipeOpt = None,
    target_sqnr: TargetSqnrOpt = None,
    fmt: FormatOpt = FormatName.QTOOL,
    config: ConfigOpt = None,
    group_fallback: GroupFallbackOpt = GroupFallback.ERROR,
    device: DeviceOpt = Device.AUTO,
    keep_nonfinite: KeepNonfiniteOpt = False,
    dry_run: DryRunOpt = False,
    estimate: EstimateOpt = False,
    threads: ThreadsOpt = None,
    max_mse: MaxMseOpt = None,
    min_sqnr: MinSqnrOpt = None,
    min_overall_sqnr: MinOverallOpt = None,
    sort: SortOpt = None,
    top: TopOpt = None,
    show_all: AllOpt = False,
    plot: PlotOpt = None,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Quantize every selected float tensor of INPUT; write the codes and a qparams sidecar
    (or, with --format compressed-tensors, a model directory transformers and vLLM load)."""
    from qtool.gates import Gate, evaluate

    bounds = Gate(max_mse, min_sqnr, min_overall_sqnr)
    mode = quantize_mode(dry_run, estimate, bounds.active, target_sqnr is not None)
    spec = build_spec(scheme, dtype, per_channel, axis, group_size, range_method)
    check_format_options(fmt, config, group_fallback)
    with user_errors(as_json) as run:
        loaded = api.load_recipe(recipe) if recipe is not None else None
        if target_sqnr is not None:
            _warn_budget_overrides(ctx, loaded)
        options = api.QuantizeOptions(
            spec,
            tuple(include or ()),
            tuple(exclude or ()),
            keep_nonfinite,
            format=fmt,
            config=config,
            group_fallback=group_fallback,
            recipe=loaded,
            target_sqnr=target_sqnr,
        )
        plot = _plot_target(plot, src, "quantize")
        also = [plot] if plot is not None else []
        summary = _run_quantize(src, out, options, api.Mode(mode), device, threads, force, also)
        run.written = [] if summary.dry_run else list(summary.outputs)
        _print_notes(summary.notes)
        if summary.ignore is not None:
            kept = ", ".join(summary.ignore) or "none"
            report.print_note(f"ignore (Linear layers kept in float): {kept}")
        if plot is not None:
            api.plot_quantize(summary, options, plot, min_sqnr, force=force)
            report.print_note(f"wrote {plot}")
    _warn_selection(summary.rows, options)
    if summary.budget_sizes is not None and len(set(summary.budget_sizes)) == 1:
        report.print_warning(
            "--target-sqnr decided no tensor: the recipe or --include/--exclude fixed or kept "
            "every one"
        )
    gate = evaluate(bounds, summary.rows, summary.overall, [])
    _show_and_gate(
        summary.rows,
        (sort.value if sort else None, top, show_all),
        gate,
        as_json,
        lambda rows: report.print_json(documents.quantize_json(summary, rows, gate)),
        lambda rows: report.print_quantize(summary, rows, gate),
    )


def _plot_target(plot: Path | None, src: Path, command: str) -> Path | None:
    """--plot names a .png file (or an existing directory for the default name)."""
    if plot is None:
        return None
    default = src.with_name(f"{src.stem}.{command}.png")
    return api.output_path(plot, default, (".png",), "--plot", flag="--plot")


_SPEC_FLAGS = {
    "scheme": "--scheme",
    "dtype": "--dtype",
    "per_channel": "--per-channel/--per-tensor",
    "axis": "--axis",
    "group_size": "--group-size",
    "range_method": "--range",
}
_PATCH_FIELD = {"scheme": "scheme", "dtype": "dtype", "range_method": "range_method"}


def _warn_budget_overrides(ctx: typer.Context, recipe: Recipe | None) -> None:
    """One stderr line naming the spec options given with --target-sqnr, which the budget's
    ladder overrides (an option still applies where a recipe rule leaves its field open)."""
    sources = {p: ctx.get_parameter_source(p) for p in _SPEC_FLAGS}
    given = [p for p, source in sources.items() if source and source.name == "COMMANDLINE"]
    patches = [
        r.action for r in (recipe.rules if recipe else ()) if isinstance(r.action, SpecPatch)
    ]
    ignored = [
        _SPEC_FLAGS[p]
        for p in given
        if not any(getattr(patch, _PATCH_FIELD.get(p, "granularity")) is None for patch in patches)
    ]
    if ignored:
        report.print_warning(
            f"{', '.join(ignored)} ignored: --target-sqnr picks each tensor's spec from its "
            "ladder (docs/recipes.md)"
        )


def _warn_selection(rows: list[QuantizeRow], options: QuantizeOptions) -> None:
    """One stderr line for globs that select nothing and for runs that quantize nothing."""
    names = [r.name for r in rows]
    for flag, patterns in (("--include", options.include), ("--exclude", options.exclude)):
        for pattern in api.unmatched_globs(names, patterns):
            report.print_warning(f"{flag} {pattern!r} matches no tensor name")
    if options.recipe is not None:
        for rule in api.unmatched_rules(options.recipe.rules, names):
            where = f"{options.recipe.path}: line {rule.line}: {rule.describe()}"
            report.print_warning(f"{where} matches no tensor")
        if options.recipe.ladder is not None and options.target_sqnr is None:
            report.print_warning(
                f"{options.recipe.path}: its ladder applies only with --target-sqnr"
            )
    if not any(r.quantized for r in rows):
        flags = "--include/--exclude/--recipe" + ("/--target-sqnr" if options.target_sqnr else "")
        report.print_warning(
            f"0 of {len(rows)} tensors selected for quantization; see the kept reasons "
            f"and check {flags}"
        )


def _show_and_gate(
    rows: list[R],
    order: tuple[str | None, int | None, bool],
    gate: GateResult,
    as_json: bool,
    as_json_doc: Callable[[list[R]], None],
    as_table: Callable[[list[R]], None],
) -> None:
    """Render the rows in `order` (--sort, --top, --all), then exit 3 if a quality gate
    failed. JSON carries every row (or --top's); a long table only its worst (see --all)."""
    sort, top, show_all = order
    if as_json:
        as_json_doc(report.arrange(rows, sort, top))
    else:
        limit = None if show_all else (TABLE_MAX_ROWS, TRIMMED_ROWS)
        as_table(report.table_rows(rows, sort, top, limit))
    if not gate.passed:
        raise typer.Exit(GATE_FAILED)


def _run_quantize(
    src: Path,
    out: Path | None,
    options: QuantizeOptions,
    mode: Mode,
    device: Device,
    threads: int | None,
    force: bool,
    also: list[Path],
) -> QuantizeSummary:
    if mode is api.Mode.PLAN:  # headers only: no kernels, no progress to show
        return api.quantize(src, out, options, mode=mode, force=force, also=also)
    _set_threads(threads)
    with report.progress_bar() as progress:
        return api.quantize(
            src, out, options, mode=mode, device=device.value, force=force, progress=progress,
            also=also,
        )  # fmt: skip


def _print_notes(notes: list[str]) -> None:
    for note in notes:
        report.print_warning(note)


@app.command(
    cls=Command,
    short_help="Per-tensor error between two checkpoints; gate a pipeline on it.",
    epilog="Example: qtool compare model.safetensors model.int8.safetensors --min-sqnr 35",
)
def compare(
    a: Annotated[
        Path,
        typer.Argument(
            metavar="A",
            help="Reference checkpoint (float, or a qtool-quantized file; a sharded set too).",
            show_default=False,
        ),
    ],
    b: Annotated[
        Path,
        typer.Argument(
            metavar="B",
            help="Checkpoint compared with A (float, or a qtool-quantized file).",
            show_default=False,
        ),
    ],
    max_mse: MaxMseOpt = None,
    min_sqnr: MinSqnrOpt = None,
    min_overall_sqnr: MinOverallOpt = None,
    pool: PoolOpt = Pool.QUANTIZED,
    sort: SortOpt = None,
    top: TopOpt = None,
    show_all: AllOpt = False,
    plot: PlotOpt = None,
    as_json: JsonOpt = False,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing --plot file.")
    ] = False,
) -> None:
    """Per-tensor error between two checkpoints sharing tensor names (quantized files are
    dequantized through their sidecars on the fly; sharded sets shard by shard)."""
    from qtool.gates import Gate, evaluate

    with user_errors(as_json):
        plot = _plot_target(plot, a, "compare")
        if plot is not None:
            api.check_outputs([plot], [a, b], force)
        summary = api.compare(a, b, pool.value)
        if plot is not None:
            api.plot_compare(summary, plot, min_sqnr, force=force)
            report.print_note(f"wrote {plot}")
    bounds = Gate(max_mse, min_sqnr, min_overall_sqnr)
    gate = evaluate(bounds, summary.rows, summary.overall, summary.mismatches)
    _show_and_gate(
        summary.rows,
        (sort.value if sort else None, top, show_all),
        gate,
        as_json,
        lambda rows: report.print_json(documents.compare_json(summary, rows, gate)),
        lambda rows: report.print_compare(summary, rows, gate),
    )


@app.command(
    cls=Command,
    short_help="Turn a quantized file back into a float checkpoint.",
    epilog="Example: qtool dequantize model.int8.safetensors -o model.restored.safetensors",
)
def dequantize(
    src: Annotated[
        Path,
        typer.Argument(
            metavar="QUANTIZED", help="A file written by qtool quantize.", show_default=False
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Output .safetensors, or .pt/.pth/.bin (torch.save), or an existing directory "
            "[default: QUANTIZED-STEM.dequantized.safetensors].",
            show_default=False,
        ),
    ] = None,
    qparams: Annotated[
        Path | None,
        typer.Option(
            "--qparams",
            help="Sidecar path [default: QUANTIZED-STEM.qparams.safetensors beside it].",
            show_default=False,
        ),
    ] = None,
    to: Annotated[
        OutDtype | None,
        typer.Option(
            "--to",
            help="Float type of the dequantized tensors: original|float32|float16|bfloat16 "
            "[default: original].",
            metavar="DTYPE",
            show_default=False,
        ),
    ] = None,
    old_dtype: Annotated[
        OutDtype | None, typer.Option("--dtype", hidden=True, show_default=False)
    ] = None,  # the spelling before --to (quantize's --dtype means the code type)
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Turn a quantized file back into a float checkpoint with the original names and dtypes."""
    if to is not None and old_dtype is not None and to != old_dtype:
        raise typer.BadParameter(
            f"{to.value} disagrees with --dtype {old_dtype.value} (the old name of --to); "
            "give one of them",
            param_hint="--to",
        )
    dtype = (to or old_dtype or OutDtype.ORIGINAL).value
    with user_errors(as_json):
        summary = api.dequantize(src, out, qparams=qparams, dtype=dtype, force=force)
        _print_notes(summary.notes)
    if as_json:
        report.print_json(documents.dequantize_json(summary))
    else:
        report.print_dequantize(summary)


@app.command(
    cls=Command,
    short_help="Draw one tensor quantized: heatmaps and a value histogram (PNG).",
    epilog="Example: qtool plot model.safetensors --tensor layers.0.fc1.weight -o fc1.png",
)
def plot(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            metavar="CHECKPOINT",
            help="A float checkpoint (.safetensors or .pt).",
            show_default=False,
        ),
    ],
    tensor: Annotated[
        str, typer.Option("--tensor", "-t", help="Name of the tensor to draw.", show_default=False)
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="PNG file, or an existing directory "
            "[default: CHECKPOINT-STEM.TENSOR.png beside the checkpoint].",
            show_default=False,
        ),
    ] = None,
    scheme: SchemeOpt = Scheme.SYM,
    dtype: DtypeOpt = StorageDtype.INT8,
    per_channel: PerChannelOpt = True,
    axis: AxisOpt = None,
    group_size: GroupSizeOpt = None,
    range_method: RangeOpt = RangeMethod.MINMAX,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Draw one tensor: original, integer codes, reconstruction and error heatmaps, and a
    histogram of its values with the quantization grid's range marked."""
    spec = build_spec(scheme, dtype, per_channel, axis, group_size, range_method)
    with user_errors(as_json):
        default = api.default_tensor_plot_path(checkpoint, tensor)
        target = api.output_path(out, default, (".png",), "plot")
        info = api.plot_tensor(checkpoint, tensor, spec, target, force=force)
    if as_json:
        report.print_json(documents.plot_json(str(checkpoint), str(target), info))
    else:
        report.print_line(f"wrote {target} ({info['spec']}, SQNR {info['sqnr_db']:.1f} dB)")


@app.command(
    cls=Command,
    short_help="List the tensors of a checkpoint, quantized file or sidecar.",
    epilog="Example: qtool inspect model.int8.safetensors --json | jq '.totals'",
)
def inspect(
    path: Annotated[
        Path,
        typer.Argument(
            metavar="FILE", help="A checkpoint, quantized file or sidecar.", show_default=False
        ),
    ],
    as_json: JsonOpt = False,
) -> None:
    """List the tensors of a file; for quantized files and sidecars, how each was quantized."""
    with user_errors(as_json):
        summary = api.inspect(path)
    if as_json:
        report.print_json(documents.inspect_json(summary))
    else:
        report.print_inspect(summary)


def _set_threads(threads: int | None) -> None:
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)
