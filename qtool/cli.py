"""The `qtool` command line: options -> pipeline -> report, and exit codes.

The only module that imports typer. Exit codes: 0 success, 1 a clear error, 2 a usage error,
3 a quality gate failed (outputs are still written), 130 interrupted (Ctrl-C), 143 terminated
(SIGTERM). Torch is imported only by the commands that
need it, so `qtool --help` and `qtool inspect model.safetensors` answer at once.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from qtool import __version__, report
from qtool.errors import InternalError, InterruptError, QtoolError, TerminatedError
from qtool.spec import QSpec, Scheme, StorageDtype

if TYPE_CHECKING:
    from qtool.gates import GateResult
    from qtool.plan import QuantizeOptions
    from qtool.summary import QuantizeSummary, TensorRow

app = typer.Typer(
    name="qtool",
    help="Quantize model checkpoints to int8/uint8, exactly, with per-layer error reports.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class Device(str, Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class OutDtype(str, Enum):
    ORIGINAL = "original"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class SortKey(str, Enum):
    NAME = "name"
    MSE = "mse"
    SQNR = "sqnr"
    SIZE = "size"


JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace existing output files.")]
MaxMseOpt = Annotated[
    float | None,
    typer.Option(help="Gate: fail (exit 3) if any tensor's MSE is above this.", show_default=False),
]
MinSqnrOpt = Annotated[
    float | None,
    typer.Option(
        help="Gate: fail (exit 3) if any tensor's SQNR (dB) is below this.", show_default=False
    ),
]
MinOverallOpt = Annotated[
    float | None,
    typer.Option(
        help="Gate: fail (exit 3) if the pooled SQNR (dB) is below this.", show_default=False
    ),
]
SortOpt = Annotated[
    SortKey | None,
    typer.Option(
        help="Order rows: name, mse/sqnr (worst first), size (largest first) "
        "[default: file order].",
        show_default=False,
    ),
]
TopOpt = Annotated[
    int | None,
    typer.Option(help="Show only the first N rows (after --sort).", min=1, show_default=False),
]
PlotOpt = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        help="Also draw per-layer SQNR and the worst layers' error histograms to this PNG "
        "(needs qtool[plot]).",
        show_default=False,
    ),
]
SchemeOpt = Annotated[
    Scheme,
    typer.Option(help="sym: scale = max|x|/127, zero point fixed; asym: affine over [min, max]."),
]
DtypeOpt = Annotated[StorageDtype, typer.Option(help="Integer type of the codes.")]
PerChannelOpt = Annotated[
    bool,
    typer.Option(
        "--per-channel/--per-tensor", help="One scale per channel along --axis, or one per tensor."
    ),
]
AxisOpt = Annotated[
    int, typer.Option(help="Channel axis for --per-channel (negative counts from the end).")
]
GATE_FAILED = 3
MAX_THREADS = 1024  # torch's thread pools crash (SIGSEGV) when asked for ~100,000 threads


class Terminated(BaseException):
    """SIGTERM, raised where the process is so that outputs are cleaned up on the way out."""


def _on_sigterm(signum: int, frame: FrameType | None) -> NoReturn:
    raise Terminated


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


@contextmanager
def user_errors(as_json: bool) -> Iterator[RunState]:
    """Expected failures become one line on stderr and exit code 1, with no traceback."""
    run = RunState()
    try:
        yield run
    except QtoolError as err:
        if os.environ.get("QTOOL_DEBUG") == "1":
            raise
        report.print_error(err, as_json)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        report.print_error(InterruptError(None, _stopped("interrupted", run)), as_json)
        raise typer.Exit(130) from None
    except Terminated:
        report.print_error(TerminatedError(None, _stopped("terminated", run)), as_json)
        raise typer.Exit(143) from None


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
    """Quantize model checkpoints to int8/uint8, exactly, with per-layer error reports."""
    warnings.showwarning = _warning_line


@app.command(
    epilog="Example: qtool quantize model.safetensors --scheme asym --per-channel "
    "-o model.int8.safetensors"
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
            help="Output .safetensors (a directory for sharded input) "
            "[default: INPUT-STEM.DTYPE.safetensors beside the input].",
            show_default=False,
        ),
    ] = None,
    scheme: SchemeOpt = Scheme.SYM,
    dtype: DtypeOpt = StorageDtype.INT8,
    per_channel: PerChannelOpt = True,
    axis: AxisOpt = 0,
    include: Annotated[
        list[str] | None,
        typer.Option(
            "--include",
            help="Glob of tensor names to quantize (repeatable); also selects 1-D tensors.",
            show_default=False,
        ),
    ] = None,
    exclude: Annotated[
        list[str] | None,
        typer.Option(
            "--exclude",
            help="Glob of tensor names to keep as they are (repeatable; wins over --include).",
            show_default=False,
        ),
    ] = None,
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
            help=f"CPU threads for torch, 1 to {MAX_THREADS} [default: all cores].",
            min=1,
            max=MAX_THREADS,
            show_default=False,
        ),
    ] = None,
    max_mse: MaxMseOpt = None,
    min_sqnr: MinSqnrOpt = None,
    min_overall_sqnr: MinOverallOpt = None,
    sort: SortOpt = None,
    top: TopOpt = None,
    plot: PlotOpt = None,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Quantize every selected float tensor of SRC; write the codes and a qparams sidecar."""
    from qtool import plan
    from qtool.gates import Gate, evaluate

    if estimate and not dry_run:
        raise typer.BadParameter("--estimate goes with --dry-run", param_hint="--estimate")
    spec = QSpec(scheme, dtype, axis if per_channel else None)
    options = plan.QuantizeOptions(spec, tuple(include or ()), tuple(exclude or ()), keep_nonfinite)
    with user_errors(as_json) as run:
        summary = plan.dry_run(src, out, options) if dry_run and not estimate else None
        if summary is None:
            summary = _run_quantize(src, out, options, device, threads, force, dry_run, estimate)
        run.written = [] if summary.dry_run else list(summary.outputs)
        if plot is not None:
            from qtool import plots

            plots.plot_quantize(summary, options, plot)
    gate = evaluate(Gate(max_mse, min_sqnr, min_overall_sqnr), summary.rows, summary.overall, [])
    _show_and_gate(
        report.arrange(summary.rows, sort.value if sort else None, top),
        gate,
        as_json,
        lambda rows: report.print_json(report.quantize_json(summary, rows, gate)),
        lambda rows: report.print_quantize(summary, rows, gate),
    )


def _show_and_gate(
    rows: list[TensorRow],
    gate: GateResult,
    as_json: bool,
    as_json_doc: Callable[[list[TensorRow]], None],
    as_table: Callable[[list[TensorRow]], None],
) -> None:
    """Render the (sorted, trimmed) rows, then exit 3 if a quality gate failed."""
    (as_json_doc if as_json else as_table)(rows)
    if not gate.passed:
        raise typer.Exit(GATE_FAILED)


def _run_quantize(
    src: Path,
    out: Path | None,
    options: QuantizeOptions,
    device: Device,
    threads: int | None,
    force: bool,
    dry_run: bool,
    estimate: bool,
) -> QuantizeSummary:
    from qtool import pipeline

    _set_threads(threads)
    with report.progress_bar() as progress:
        return pipeline.quantize_path(
            src,
            out,
            options,
            device=device.value,
            force=force,
            dry_run=dry_run,
            estimate=estimate,
            progress=progress,
        )


@app.command(epilog="Example: qtool compare model.safetensors model.int8.safetensors --min-sqnr 35")
def compare(
    a: Annotated[
        Path,
        typer.Argument(
            metavar="A",
            help="Reference checkpoint (float, or a qtool-quantized file).",
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
    plot: PlotOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Per-tensor error between two checkpoints sharing tensor names (quantized files are
    dequantized through their sidecars on the fly)."""
    from qtool.compare import compare_files
    from qtool.gates import Gate, evaluate

    with user_errors(as_json):
        summary = compare_files(a, b)
        if plot is not None:
            from qtool import plots

            plots.plot_compare(summary, plot)
    bounds = Gate(max_mse, min_sqnr, min_overall_sqnr)
    gate = evaluate(bounds, summary.rows, summary.overall, summary.mismatches)
    _show_and_gate(
        report.arrange(summary.rows, sort.value if sort else None, top),
        gate,
        as_json,
        lambda rows: report.print_json(report.compare_json(summary, rows, gate)),
        lambda rows: report.print_compare(summary, rows, gate),
    )


@app.command(
    epilog="Example: qtool dequantize model.int8.safetensors -o model.restored.safetensors"
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
            help="Output .safetensors, or .pt [default: INPUT-STEM.dequantized.safetensors].",
            show_default=False,
        ),
    ] = None,
    qparams: Annotated[
        Path | None,
        typer.Option(
            "--qparams",
            help="Sidecar path [default: INPUT-STEM.qparams.safetensors beside the input].",
            show_default=False,
        ),
    ] = None,
    dtype: Annotated[
        OutDtype, typer.Option(help="dtype of the restored tensors.")
    ] = OutDtype.ORIGINAL,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Turn a quantized file back into a float checkpoint with the original names and dtypes."""
    from qtool import restore

    with user_errors(as_json):
        summary = restore.dequantize_path(src, out, qparams=qparams, dtype=dtype.value, force=force)
    if as_json:
        report.print_json(report.dequantize_json(summary))
    else:
        report.print_dequantize(summary)


@app.command(epilog="Example: qtool plot model.safetensors --tensor layers.0.fc1.weight -o fc1.png")
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
            help="PNG path [default: CHECKPOINT-STEM.TENSOR.png beside the checkpoint].",
            show_default=False,
        ),
    ] = None,
    scheme: SchemeOpt = Scheme.SYM,
    dtype: DtypeOpt = StorageDtype.INT8,
    per_channel: PerChannelOpt = True,
    axis: AxisOpt = 0,
    force: ForceOpt = False,
) -> None:
    """Draw one tensor: original, integer codes, reconstruction and error heatmaps, and a
    histogram of its values with the quantization grid's range marked."""
    from qtool import plots

    with user_errors(False):
        target = out or plots.default_tensor_plot_path(checkpoint, tensor)
        if target.exists() and not force:
            raise QtoolError(target, "already exists; pass --force to replace it")
        info = plots.plot_tensor(
            checkpoint, tensor, QSpec(scheme, dtype, axis if per_channel else None), target
        )
    report.print_line(f"wrote {target} ({info['spec']}, SQNR {info['sqnr_db']:.1f} dB)")


@app.command(epilog="Example: qtool inspect model.int8.safetensors --json | jq '.totals'")
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
    from qtool.inspection import inspect_path

    with user_errors(as_json):
        summary = inspect_path(path)
    if as_json:
        report.print_json(report.inspect_json(summary))
    else:
        report.print_inspect(summary)


def _set_threads(threads: int | None) -> None:
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)


def main() -> None:
    """Entry point: maps interruptions and unexpected failures to exit codes, never a traceback."""
    closed = _reopen_closed_std_streams()
    as_json = "--json" in sys.argv[1:]
    if "stdout" in closed:
        report.print_warning("stdout is closed; the report is discarded")
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        app(prog_name="qtool")
    except Terminated:
        report.print_error(TerminatedError(None, "terminated"), as_json)
        sys.exit(143)
    except KeyboardInterrupt:
        report.print_error(InterruptError(None, "interrupted"), as_json)
        sys.exit(130)
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


def _silence_stdout() -> None:
    """After EPIPE, point stdout at /dev/null so the interpreter's final flush stays quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
