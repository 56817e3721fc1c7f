"""The `qtool` command line: options -> api -> report, and exit codes.

The only module that imports typer. Exit codes: 0 success, 1 a clear error, 2 a usage error,
3 a quality gate failed (outputs are still written), 130 interrupted (Ctrl-C), 143 terminated
(SIGTERM). Torch is imported only by the commands that
need it, so `qtool --help` and `qtool inspect model.safetensors` answer at once.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import re
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from typer.core import TyperCommand

from qtool import __version__
from qtool.cli.options import (
    MAX_THREADS,
    TABLE_MAX_ROWS,
    TRIMMED_ROWS,
    AllOpt,
    AxisOpt,
    DtypeOpt,
    ForceOpt,
    GroupSizeOpt,
    JsonOpt,
    MaxMseOpt,
    MinOverallOpt,
    MinSqnrOpt,
    OutDtype,
    PerChannelOpt,
    PlotOpt,
    RangeOpt,
    SchemeOpt,
    SortOpt,
    TargetSqnrOpt,
    TopOpt,
    build_spec,
    thread_count,
)
from qtool.errors import (
    InternalError,
    InterruptError,
    QtoolError,
    TerminatedError,
    UsageError,
)
from qtool.spec import (
    Device,
    FormatName,
    GroupFallback,
    RangeMethod,
    Scheme,
    StorageDtype,
)

if TYPE_CHECKING:
    from qtool.api import Mode, QuantizeOptions
    from qtool.gates import GateResult
    from qtool.results import QuantizeRow, QuantizeSummary, Row

R = TypeVar("R", bound="Row")


def lazy_module(name: str) -> ModuleType:
    """The module `name`, executed on its first attribute access (importlib's LazyLoader):
    `qtool --help` and usage errors never pay for the engine or Rich."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING:
    from qtool import api
    from qtool.report import console as report
    from qtool.report import json as documents
else:
    api = lazy_module("qtool.api")
    report = lazy_module("qtool.report.console")
    documents = lazy_module("qtool.report.json")


class _Command(TyperCommand):
    """Usage lines show arguments as INPUT, not Typer's {INPUT}."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces: list[str] = super().collect_usage_pieces(ctx)
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


app = typer.Typer(
    name="qtool",
    help="Quantize model checkpoints to 8- or 4-bit integers, exactly, with per-layer errors.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


GATE_FAILED = 3


class Terminated(BaseException):
    """SIGTERM, raised where the process is so that outputs are cleaned up on the way out."""


def _on_sigterm(signum: int, frame: FrameType | None) -> NoReturn:
    raise Terminated


@contextmanager
def user_errors(as_json: bool) -> Iterator[RunState]:
    """Expected failures become one line on stderr and exit code 1 (2 for usage), with no
    traceback; an interruption says truthfully what was already written."""
    run = RunState()
    try:
        yield run
    except QtoolError as err:
        if os.environ.get("QTOOL_DEBUG") == "1":
            raise
        report.print_error(with_option_names(err), as_json)
        raise typer.Exit(2 if isinstance(err, UsageError) else 1) from None
    except KeyboardInterrupt:
        report.print_error(InterruptError(None, _stopped("interrupted", run)), as_json)
        raise typer.Exit(130) from None
    except Terminated:
        report.print_error(TerminatedError(None, _stopped("terminated", run)), as_json)
        raise typer.Exit(143) from None


# How the command line spells what the engine's hints ask of the user.
OPTION_HINTS = {
    "axis": "--axis N",
    "config": "--config PATH",
    "device": "--device cpu",
    "dtype": "--dtype int8|int4",
    "estimate": "--estimate",
    "exclude": "--exclude NAME",
    "force": "pass --force",
    "group-fallback": "--group-fallback channel|keep",
    "keep-nonfinite": "--keep-nonfinite",
    "qparams": "--qparams PATH",
    "restore-dtype": "--to float32",
}


def with_option_names(err: QtoolError) -> QtoolError:
    """The error with its hints spelled as this command line's options, e.g. `(pass --force)`."""
    names = [OPTION_HINTS[h] for h in err.hints if h in OPTION_HINTS]
    if not names:
        return err
    rendered = type(err).__new__(type(err))  # (copy.copy would re-run __init__ with args)
    rendered.__dict__.update(err.__dict__, message=f"{err.message} ({'; '.join(names)})")
    return rendered


@dataclass
class RunState:
    """What a command has done so far, so that an interruption reports it truthfully."""

    written: list[str] = field(default_factory=list)


def _stopped(what: str, run: RunState) -> str:
    if run.written:
        return (
            f"{what} after {', '.join(run.written)} were written (complete); the rest was not done"
        )
    return f"{what}; no output was written"


def _warning_line(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: object = None,
    line: str | None = None,
) -> None:
    """A library warning (torch's UserWarnings) as one qtool line: its first sentence."""
    text = " ".join(str(message).split())
    first = text.split(". ", 1)[0].split(" (Triggered internally", 1)[0].rstrip(".")
    origin = "torch" if f"{os.sep}torch{os.sep}" in filename else category.__name__
    report.print_warning(f"{origin}: {first or category.__name__}")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"qtool {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Show the version."),
    ] = False,
) -> None:
    """Quantize model checkpoints to 8- or 4-bit integers, exactly, with per-layer error reports."""
    warnings.showwarning = _warning_line


@app.command(
    cls=_Command,
    short_help="Quantize a checkpoint: codes, a qparams sidecar, an error table.",
    epilog="Example: qtool quantize model.safetensors --scheme asym --per-channel "
    "-o model.int8.safetensors",
)
def quantize(
    src: Annotated[
        Path,
        typer.Argument(
            metavar="INPUT",
            help="Checkpoint: .safetensors, a .pt/.pth/.bin state dict, "
            "or a sharded checkpoint (its *.safetensors.index.json or directory).",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Output .safetensors file, or an existing directory to put the default name in "
            "(for sharded input, and for --format compressed-tensors: the output directory) "
            "[default: INPUT-STEM.DTYPE.safetensors beside the input].",
            show_default=False,
        ),
    ] = None,
    scheme: SchemeOpt = Scheme.SYM,
    dtype: DtypeOpt = StorageDtype.INT8,
    per_channel: PerChannelOpt = True,
    axis: AxisOpt = None,
    group_size: GroupSizeOpt = None,
    range_method: RangeOpt = RangeMethod.MINMAX,
    include: Annotated[
        list[str] | None,
        typer.Option(
            "--include",
            help="Glob of tensor names to quantize (repeatable); also selects 1-D tensors.",
            metavar="GLOB",
            show_default=False,
        ),
    ] = None,
    exclude: Annotated[
        list[str] | None,
        typer.Option(
            "--exclude",
            help="Glob of tensor names to keep as they are (repeatable; tried first, see "
            "'Recipes' in the README for the order).",
            metavar="GLOB",
            show_default=False,
        ),
    ] = None,
    recipe: Annotated[
        Path | None,
        typer.Option(
            "--recipe",
            help="TOML file of per-tensor rules: a spec or keep-in-float per name pattern.",
            metavar="FILE",
            show_default=False,
        ),
    ] = None,
    target_sqnr: TargetSqnrOpt = None,
    fmt: Annotated[
        FormatName,
        typer.Option(
            "--format",
            help="qtool: codes plus a qparams sidecar. compressed-tensors: a model directory "
            "(pack-quantized) that transformers and vLLM load; needs -o DIR.",
        ),
    ] = FormatName.QTOOL,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="The model's config.json, for --format compressed-tensors from a single "
            ".safetensors file [default: INPUT/config.json for a model directory].",
            metavar="PATH",
            show_default=False,
        ),
    ] = None,
    group_fallback: Annotated[
        GroupFallback,
        typer.Option(
            "--group-fallback",
            help="compressed-tensors, when --group-size does not divide a tensor's row length: "
            "error (name them), channel (those per channel) or keep (those in float).",
        ),
    ] = GroupFallback.ERROR,
    device: Annotated[
        Device, typer.Option(help="Where the kernels run; auto picks CUDA when available.")
    ] = Device.AUTO,
    keep_nonfinite: Annotated[
        bool,
        typer.Option(
            "--keep-nonfinite", help="Keep tensors holding NaN/Inf unquantized instead of failing."
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Print what would be done (from headers only) and write nothing."
        ),
    ] = False,
    estimate: Annotated[
        bool,
        typer.Option(
            "--estimate",
            help="With --dry-run: also compute the error figures (reads the data, writes nothing).",
        ),
    ] = False,
    threads: Annotated[
        int | None,
        typer.Option(
            help=f"CPU threads for the kernels, 1 to {MAX_THREADS} [default: all cores].",
            callback=thread_count,
            metavar="N",
            show_default=False,
        ),
    ] = None,
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

    if estimate and not dry_run:
        raise typer.BadParameter("goes only with --dry-run", param_hint="--estimate")
    bounds = Gate(max_mse, min_sqnr, min_overall_sqnr)
    if dry_run and not estimate and bounds.active:
        raise typer.BadParameter(
            "a gate needs error figures, which a plain dry run does not compute; "
            "add --estimate (or drop --dry-run)",
            param_hint="--dry-run",
        )
    if dry_run and not estimate and target_sqnr is not None:
        raise typer.BadParameter(
            "the error budget measures each tensor, which a plain dry run does not; "
            "add --estimate (or drop --dry-run)",
            param_hint="--target-sqnr",
        )
    spec = build_spec(scheme, dtype, per_channel, axis, group_size, range_method)
    only_ct = config is not None or group_fallback is not GroupFallback.ERROR
    if fmt is FormatName.QTOOL and only_ct:
        raise typer.BadParameter(
            "--config and --group-fallback go with --format compressed-tensors",
            param_hint="--format",
        )
    with user_errors(as_json) as run:
        loaded = api.load_recipe(recipe) if recipe is not None else None
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
        mode = api.Mode.ESTIMATE if estimate else api.Mode.PLAN if dry_run else api.Mode.WRITE
        also = [plot] if plot is not None else []
        summary = _run_quantize(src, out, options, mode, device, threads, force, also)
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
    cls=_Command,
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
        summary = api.compare(a, b)
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
    cls=_Command,
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
    cls=_Command,
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
    cls=_Command,
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


def main(argv: list[str] | None = None) -> None:
    """Entry point: maps usage errors, interruptions and unexpected failures to exit codes and
    one line on stderr, never a traceback.

    The cyclic garbage collector is paused while the command runs: qtool's work per tensor
    creates no reference cycles (refcounting frees it; tests/test_cli.py checks it; imports and
    a --plot figure leave some, once), so the collector would only walk the ever larger heap of
    headers, plans and rows again and again: ~40 % of quantizing 50,000 tiny tensors."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        _run_command(argv)
    finally:
        if collecting:
            gc.enable()


def _run_command(argv: list[str] | None) -> None:
    closed = _reopen_closed_std_streams()
    args = sys.argv[1:] if argv is None else argv
    as_json = "--json" in args
    if "stdout" in closed:
        report.print_warning("stdout is closed; the report is discarded")
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        code = app(args=args, prog_name="qtool", standalone_mode=False)
    except typer.TyperException as err:  # Typer's usage errors (and its own abort)
        code = _usage_error(err, as_json)
    except (typer.Abort, KeyboardInterrupt):
        report.print_error(InterruptError(None, "interrupted"), as_json)
        sys.exit(130)
    except Terminated:
        report.print_error(TerminatedError(None, "terminated"), as_json)
        sys.exit(143)
    except BrokenPipeError:
        _silence_stdout()
        sys.exit(1)
    except QtoolError as err:  # the report itself could not be written (stdout full, EIO)
        _silence_stdout()
        report.print_error(err, as_json)
        sys.exit(1)
    except Exception as err:  # a bug: one line, and the traceback only when asked for
        if os.environ.get("QTOOL_DEBUG") == "1":
            raise
        message = (
            f"internal error: {type(err).__name__}: {err}; re-run with QTOOL_DEBUG=1 for the "
            "traceback and report it"
        )
        report.print_error(InternalError(None, message), as_json)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


def _reopen_closed_std_streams() -> list[str]:
    """A closed stdin/stdout/stderr (`>&-`) becomes /dev/null before any file is opened:
    otherwise an output file could get descriptor 1 and receive the report. Returns their names."""
    closed = []
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            closed.append(name)
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            if getattr(sys, name) is None:
                mode = "r" if fd == 0 else "w"
                setattr(sys, name, open(fd, mode, encoding="utf-8", closefd=False))  # noqa: SIM115
    return closed


def _usage_error(err: typer.TyperException, as_json: bool) -> int:
    """Print a usage error as one line (or JSON) on stderr; the exit code (2) to use."""
    text = err.format_message()
    if text.startswith("Usage:"):  # `qtool` alone: the help is the answer
        sys.stderr.write(text + "\n")
        return err.exit_code
    report.print_error(UsageError(None, usage_message(text)), as_json)
    return err.exit_code


def usage_message(text: str) -> str:
    """Typer's wording, one line: "Invalid value for '--scheme': Value error, 'foo' is not one
    of 'sym', 'asym'." -> "--scheme: 'foo' is not one of sym, asym"."""
    text = re.sub(r"^Invalid value for (.+?): ", lambda m: m[1].replace("'", "") + ": ", text)
    for pattern, plain in _PLAIN_WORDING:
        text = re.sub(pattern, plain, text)
    return " ".join(text.split()).rstrip(".")


_PLAIN_WORDING = (  # pydantic's phrases, as Typer passes them on, in the words of a CLI
    (r"(Value|Input) error, ", ""),
    (r"is not one of (.+?)\.?$", lambda m: "is not one of " + m[1].replace("'", "")),
    (r"Input should be greater than or equal to (\S+)", r"must be at least \1"),
    (r"Input should be less than or equal to (\S+)", r"must be at most \1"),
    (r"Input should be a valid integer.*", "expects a whole number"),
    (r"Input should be a valid number.*", "expects a number"),
)


def _silence_stdout() -> None:
    """After EPIPE, point stdout at /dev/null so the interpreter's final flush stays quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
