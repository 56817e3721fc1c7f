"""`qtool quantize`: parse the options, run qtool.api.quantize, render the table or JSON."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from qtool.cli.app import app
from qtool.cli.errors import user_errors
from qtool.cli.help import DEBUG_ENV, KERNEL_ENV, Command, epilog
from qtool.cli.lazy import api, documents, report
from qtool.cli.method_options import (
    CalibCtxOpt,
    CalibTextOpt,
    CalibTokensOpt,
    CheckTextOpt,
    GuardOpt,
    MaxKlRatioOpt,
    MethodOpt,
    ToleranceOpt,
    calibration,
    check_kl_gate,
    check_method,
)
from qtool.cli.options import (
    AllOpt,
    AxisOpt,
    ForceOpt,
    GroupSizeOpt,
    JsonOpt,
    MaxMseOpt,
    MinOverallOpt,
    MinSqnrOpt,
    PerChannelOpt,
    PlotOpt,
    RangeOpt,
    SchemeOpt,
    SortOpt,
    TopOpt,
    build_spec,
)
from qtool.cli.quantize_options import (
    AllowRequantizeOpt,
    ConfigOpt,
    DeviceOpt,
    DryRunOpt,
    EstimateOpt,
    ExcludeOpt,
    FormatOpt,
    GroupFallbackOpt,
    ImatrixOpt,
    ImatrixUseOpt,
    IncludeOpt,
    InputArg,
    KeepNonfiniteOpt,
    QuantizeDtypeOpt,
    QuantizeOutOpt,
    RecipeOpt,
    SaveRecipeOpt,
    TargetBpwOpt,
    TargetKlOpt,
    TargetSizeOpt,
    TargetSqnrOpt,
    TensorTypeFileOpt,
    ThreadsOpt,
    allocation_target,
    check_format_options,
    check_format_spec,
    check_imatrix,
    check_imatrix_use,
    check_plan_files,
    gguf_cli_spec,
    quantize_mode,
    warn_budget_overrides,
)
from qtool.cli.render import Shown, plot_target, print_notes, show_and_gate
from qtool.spec import (
    Codec,
    Device,
    FormatName,
    GroupFallback,
    ImatrixUse,
    RangeMethod,
    Scheme,
    StorageDtype,
)

if TYPE_CHECKING:
    from qtool.api import Mode, QuantizeOptions
    from qtool.gates import Gate
    from qtool.results import QuantizeSummary


@app.command(
    cls=Command,
    short_help="Quantize a checkpoint: codes, a qparams sidecar, an error table.",
    epilog=epilog(
        "qtool quantize model.safetensors --dtype int4 --group-size 32 -o model.int4.safetensors",
        KERNEL_ENV,
        DEBUG_ENV,
    ),
)
def quantize(
    ctx: typer.Context,
    src: InputArg,
    out: QuantizeOutOpt = None,
    scheme: SchemeOpt = Scheme.SYM,
    dtype: QuantizeDtypeOpt = StorageDtype.INT8.value,
    per_channel: PerChannelOpt = True,
    axis: AxisOpt = None,
    group_size: GroupSizeOpt = None,
    range_method: RangeOpt = RangeMethod.MINMAX,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    recipe: RecipeOpt = None,
    target_sqnr: TargetSqnrOpt = None,
    target_size: TargetSizeOpt = None,
    target_bpw: TargetBpwOpt = None,
    target_kl: TargetKlOpt = None,
    save_recipe: SaveRecipeOpt = None,
    tensor_type_file: TensorTypeFileOpt = None,
    fmt: FormatOpt = FormatName.QTOOL,
    config: ConfigOpt = None,
    group_fallback: GroupFallbackOpt = GroupFallback.ERROR,
    allow_requantize: AllowRequantizeOpt = False,
    device: DeviceOpt = Device.AUTO,
    keep_nonfinite: KeepNonfiniteOpt = False,
    imatrix: ImatrixOpt = None,
    imatrix_use: ImatrixUseOpt = ImatrixUse.ALL,
    method: MethodOpt = None,
    text: CalibTextOpt = None,
    tokens: CalibTokensOpt = None,
    calib_ctx: CalibCtxOpt = None,
    check_text: CheckTextOpt = None,
    guard: GuardOpt = None,
    tolerance: ToleranceOpt = None,
    dry_run: DryRunOpt = False,
    estimate: EstimateOpt = False,
    threads: ThreadsOpt = None,
    max_mse: MaxMseOpt = None,
    min_sqnr: MinSqnrOpt = None,
    min_overall_sqnr: MinOverallOpt = None,
    max_kl_ratio: MaxKlRatioOpt = None,
    sort: SortOpt = None,
    top: TopOpt = None,
    show_all: AllOpt = False,
    plot: PlotOpt = None,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Quantize every selected float tensor of INPUT; write the codes and a qparams sidecar
    (or, with --format compressed-tensors, a model directory transformers and vLLM load; with
    --format gguf, a float GGUF's tensors in GGUF types, a file llama.cpp loads)."""
    from qtool.gates import Gate, evaluate

    bounds = Gate(max_mse, min_sqnr, min_overall_sqnr, max_kl_ratio)
    check_kl_gate(method, max_kl_ratio)
    integer_grid = dtype in {d.value for d in StorageDtype}
    spec = (
        build_spec(scheme, StorageDtype(dtype), per_channel, axis, group_size, range_method)
        if integer_grid
        else gguf_cli_spec(dtype, scheme, per_channel, axis, group_size, range_method, ctx)
    )
    calibrated = calibration(method, text, tokens, calib_ctx, check_text, guard, tolerance)
    target = allocation_target(target_size, target_bpw, target_kl, target_sqnr)
    check_method(calibrated, fmt, integer_grid, target_sqnr if target is None else target.value,
                 dry_run, estimate)  # fmt: skip
    check_plan_files(target, save_recipe, tensor_type_file, fmt == FormatName.GGUF.value,
                     dry_run, estimate)  # fmt: skip
    mode = quantize_mode(dry_run, estimate, _measured(bounds, plot), target_sqnr is not None)
    check_format_options(fmt, config, group_fallback)
    if allow_requantize and fmt != FormatName.GGUF.value:
        raise typer.BadParameter("quantizes a GGUF into a GGUF: add --format gguf",
                                 param_hint="--allow-requantize")  # fmt: skip
    check_format_spec(fmt, spec, budget=target_sqnr is not None or target is not None)
    gguf, minmax = fmt == FormatName.GGUF.value, range_method is RangeMethod.MINMAX
    check_imatrix(imatrix, target_sqnr is not None, method is not None, gguf=gguf,
                  minmax=minmax and target is None, recipe=recipe is not None)  # fmt: skip
    check_imatrix_use(imatrix_use, imatrix, target)
    with user_errors(as_json) as run:
        options = _options(spec, include, exclude, keep_nonfinite, fmt, config, group_fallback,
                           recipe, target_sqnr, imatrix)  # fmt: skip
        weighs = imatrix_use is ImatrixUse.ALL
        options = dataclasses.replace(options, calibration=calibrated, allocation=target,
                                      save_recipe=save_recipe, save_tensor_types=tensor_type_file,
                                      imatrix_weighs_codes=weighs)  # fmt: skip
        if options.budgeted:
            warn_budget_overrides(
                ctx, options, "--target-sqnr" if target is None else f"--target-{target.kind}"
            )
        plot = plot_target(plot, src, "quantize")
        if allow_requantize:
            _warn_requantize(src)
        summary = _run(src, out, options, api.Mode(mode), device, threads, force, plot,
                       allow_requantize)  # fmt: skip
        run.written = [] if summary.dry_run else list(summary.outputs)
        _notes(summary, as_json)
        if plot is not None:
            api.plot_quantize(summary, options, plot, min_sqnr, force=force)
            report.print_note(f"wrote {plot}")
    _warn(summary, options)
    gate = evaluate(bounds, summary.rows, summary.overall, [], summary.model_kl)
    show_and_gate(
        summary.rows,
        Shown(sort, top, show_all),
        gate,
        as_json,
        lambda rows: report.print_json(documents.quantize_json(summary, rows, gate)),
        lambda rows: report.print_quantize(summary, rows, gate),
    )


def _options(
    spec: Codec,
    include: list[str] | None,
    exclude: list[str] | None,
    keep_nonfinite: bool,
    fmt: str,
    config: Path | None,
    group_fallback: GroupFallback,
    recipe: Path | None,
    target_sqnr: float | None,
    imatrix: Path | None = None,
) -> QuantizeOptions:
    """The options value the engine takes (the recipe read and checked: RecipeError, exit 2)."""
    return api.QuantizeOptions(
        spec,
        tuple(include or ()),
        tuple(exclude or ()),
        keep_nonfinite,
        format=FormatName(fmt),
        config=config,
        group_fallback=group_fallback,
        recipe=api.load_recipe(recipe) if recipe is not None else None,
        target_sqnr=target_sqnr,
        imatrix=imatrix,
    )


def _measured(bounds: Gate, plot: Path | None) -> str | None:
    """The first option given that needs error figures (a plain dry run has none)."""
    asked = {
        "--max-mse": bounds.max_mse is not None,
        "--min-sqnr": bounds.min_sqnr is not None,
        "--min-overall-sqnr": bounds.min_overall_sqnr is not None,
        "--plot": plot is not None,
    }
    return next((flag for flag, given in asked.items() if given), None)


def _run(
    src: Path,
    out: Path | None,
    options: QuantizeOptions,
    mode: Mode,
    device: Device,
    threads: int | None,
    force: bool,
    plot: Path | None,
    allow_requantize: bool = False,
) -> QuantizeSummary:
    # checked with -o as outputs of the run: never an input, the recipe or imatrix included
    named = (plot, options.save_recipe, options.save_tensor_types)
    also = [p for p in named if p is not None]
    if mode is api.Mode.PLAN and not allow_requantize:  # headers only: no progress to show
        return api.quantize(
            src, out, options, mode=mode, device=device.value, force=force, also=also
        )
    with report.progress_bar() as progress:
        return api.quantize(
            src, out, options, mode=mode, device=device.value, force=force, progress=progress,
            also=also, threads=threads, allow_requantize=allow_requantize,
        )  # fmt: skip


def _warn_requantize(src: Path) -> None:
    """--allow-requantize: one warning line when INPUT is an already quantized GGUF (a float
    one is quantized as usual)."""
    what = api.quantized_gguf(src)
    if what is not None:
        report.print_warning(
            f"{src}: {what}, quantized again: its codes' error is kept and the new codes add "
            "their own (quality is lost twice; quantize the float original where you have it)"
        )


def _notes(summary: QuantizeSummary, as_json: bool) -> None:
    """The run's notes; the Linear layers a compressed-tensors export kept in float, if any
    (summarised; not under --json, whose `ignore` lists them)."""
    print_notes(summary.notes)
    methods = [
        r.decided_by.method for r in summary.rows if r.decided_by is not None and r.quantized
    ]
    chosen = [m for m in methods if m is not None]
    if chosen:
        kept = [m for m in chosen if m != "rtn"]
        # awq+gptq gives some Linears awq, some gptq, some both: each is counted
        counts = [f"{m} for {n}" for m, n in Counter(kept).most_common()]
        name = " kept for ".join(counts[0].split(" for ", 1)) if counts else ""
        name = ", ".join([name, *counts[1:]]) or "the calibrated method kept for 0"
        others = "; the others rounded to nearest (the table says why)"
        report.print_note(f"{name} of {len(chosen)} Linear layers of the "
                          f"decoder blocks{others if len(kept) < len(chosen) else ''}")  # fmt: skip
    if summary.ignore and not as_json:
        report.print_note(report.ignore_note(summary.ignore))


def _kept_by_allocation(summary: QuantizeSummary, options: QuantizeOptions) -> str | None:
    """A run that quantizes nothing because the allocation target kept float every tensor it
    decided (a target at or above their float size), not because no tensor was selected."""
    target = options.allocation
    decided = [r for r in summary.rows if r.decided_by and r.decided_by.origin == "budget"]
    if target is None or not decided:
        return None
    lower = "allow a larger KL" if target.kind == "kl" else "aim lower"
    return (
        f"0 of {len(summary.rows)} tensors quantized: --target-{target.kind}'s allocation "
        f"({target.describe()}) kept float all {len(decided)} tensors it decided, as their float "
        f"size meets it (see the kept reasons); {lower} to quantize them"
    )


def _kl_not_measured(summary: QuantizeSummary) -> str | None:
    """The warning for a --target-kl plan written unmeasured (the input cannot be run): its KL
    is the prediction's, the target unchecked."""
    plan = summary.allocation
    if plan is None or plan.target != "kl" or plan.measured_kl == plan.measured_kl:
        return None  # not a KL target, or measured (NaN: not)
    why = plan.measured_on.removeprefix("not measured: ")
    return (
        f"--target-kl {plan.target_value:g} was not checked: {why}, so the plan written is "
        f"the one predicted at KL {plan.loss:.4g}, not measured"
    )


def _warn(summary: QuantizeSummary, options: QuantizeOptions) -> None:
    """One stderr line for globs and rules that select nothing, for runs that quantize
    nothing, and for a budget that decided nothing."""
    names = [r.name for r in summary.rows]
    for flag, patterns in (("--include", options.include), ("--exclude", options.exclude)):
        for pattern in api.unmatched_globs(names, patterns):
            report.print_warning(f"{flag} {pattern!r} matches no tensor name")
    if options.recipe is not None:
        for rule in api.unmatched_rules(options.recipe.rules, names):
            where = f"{options.recipe.path}: line {rule.line}: {rule.describe()}"
            report.print_warning(f"{where} matches no tensor")
        if options.recipe.ladder is not None and not options.budgeted:
            report.print_warning(
                f"{options.recipe.path}: its ladder applies only with --target-sqnr"
            )
    converted = options.spec.conversion  # --dtype F16: nothing to
    if not any(r.quantized for r in summary.rows) and not converted:  # quantize, by design
        flags = "--include/--exclude/--recipe" + ("/--target-sqnr" if options.target_sqnr else "")
        kept = _kept_by_allocation(summary, options)
        report.print_warning(
            kept
            if kept is not None
            else f"0 of {len(summary.rows)} tensors selected for quantization; see the kept "
            f"reasons and check {flags}"
        )
    unchecked = _kl_not_measured(summary)
    if unchecked is not None:
        report.print_warning(unchecked)
    if summary.budget_sizes is not None and len(set(summary.budget_sizes)) == 1:
        target = options.allocation
        flag = "--target-sqnr" if target is None else f"--target-{target.kind}"
        report.print_warning(
            f"{flag} decided no tensor: the recipe or --include/--exclude fixed or kept every one"
        )
