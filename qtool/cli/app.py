"""The `qtool` program around its commands (one module per command in qtool/cli/, each
registering itself on `app`): the Typer app, the entry point, signals, exit codes and the
mapping of errors to one line.

Exit codes: 0 success, 1 a clear error, 2 a usage error, 3 a quality gate failed (outputs are
still written), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM). Only cli/ imports typer.
Torch, Rich and the engine are loaded only when a command needs them (cli/lazy.py), so
`qtool --help` and `qtool inspect model.safetensors` answer at once.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import warnings
from types import FrameType
from typing import Annotated, NoReturn

import typer

from qtool import __version__
from qtool.cli.errors import Terminated, usage_line
from qtool.cli.help import DEBUG_ENV, KERNEL_ENV, Group
from qtool.cli.lazy import report
from qtool.errors import InternalError, InterruptError, QtoolError, TerminatedError, UsageError

app = typer.Typer(  # its commands register themselves when qtool.cli imports them
    name="qtool",
    cls=Group,
    help="Quantize model checkpoints to 8- or 4-bit integers, exactly, with per-layer errors.",
    epilog=f"{KERNEL_ENV}\n\n{DEBUG_ENV}",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _on_sigterm(signum: int, frame: FrameType | None) -> NoReturn:
    raise Terminated


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


def main(argv: list[str] | None = None) -> None:
    """Entry point: maps usage errors, interruptions and unexpected failures to exit codes and
    one line on stderr, never a traceback.

    The cyclic garbage collector is paused while the command runs: qtool's work per tensor
    creates no reference cycles (refcounting frees it; tests/cli/test_cli.py checks it; imports and
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
        code = _usage_error(err, args, as_json)
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


def _usage_error(err: typer.TyperException, args: list[str], as_json: bool) -> int:
    """Print a usage error as one line (or JSON) on stderr; the exit code (2) to use."""
    text = err.format_message()
    if text.startswith("Usage:"):  # `qtool` alone: the help is the answer
        sys.stderr.write(text + "\n")
        return err.exit_code
    report.print_error(UsageError(None, usage_line(err, args)), as_json)
    return err.exit_code


def _silence_stdout() -> None:
    """After EPIPE, point stdout at /dev/null so the interpreter's final flush stays quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
