"""The `qtool` program around its commands (one module per command in qtool/cli/, each
registering itself on `app`): the Typer app, the entry point, signals, exit codes and the
mapping of errors to one line.

Exit codes: 0 success, 1 a clear error, 2 a usage error, 3 a quality gate failed (outputs are
still written), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM). Only cli/ imports typer.
Torch, Rich and the engine are loaded only when a command needs them (cli/lazy.py), so
`qtool --help` and `qtool inspect model.safetensors` answer at once.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import warnings
from types import FrameType
from typing import Annotated, NoReturn

import typer

from qtool import __version__
from qtool.cli.deferred import defer_signals_in_imports
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


def _warning_line(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: object = None,
    line: str | None = None,
) -> None:
    """A library warning (torch's UserWarnings) as one qtool line: its first sentence; one of
    qtool's own as its message alone (its class name means nothing to a user)."""
    text = " ".join(str(message).split())
    if category.__module__.split(".")[0] == "qtool":
        report.print_warning(text)
        return
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
    if argv is None:  # the process's own: its imports from now on defer signals (deferred.py)
        defer_signals_in_imports()
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        code = _run_command(argv)
    finally:
        if collecting:
            gc.enable()
        if argv is not None:  # called in-process (a test): its signals are handed back
            signal.signal(signal.SIGTERM, handlers[0])
            signal.signal(signal.SIGINT, handlers[1])
    if argv is None:
        _end_process(code)
    sys.exit(code)


def _end_process(code: int) -> NoReturn:
    """The process ends as soon as its command is done. Its outputs are published and closed
    and its report printed; the interpreter's shutdown (a second or more, tearing down torch)
    has nothing left to do for them, and a signal arriving during it was raised inside a
    finalizer, which printed "Exception ignored ... Traceback" and exited 0."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or half-written stream: let it be
            stream.flush()
    os._exit(code)


def _run_command(argv: list[str] | None) -> int:
    closed = _reopen_closed_std_streams()
    args = sys.argv[1:] if argv is None else argv
    as_json = "--json" in args
    if "stdout" in closed:
        report.print_warning("stdout is closed; the report is discarded")
    _finishing.code = None
    _finishing.ends_process = argv is None
    signal.signal(signal.SIGTERM, _on_signal)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when ignored (`&`)
        signal.signal(signal.SIGINT, _on_signal)
    try:
        code = app(args=args, prog_name="qtool", standalone_mode=False)
        _finishing.code = code if isinstance(code, int) else 0  # done: a signal ends it quietly
    except typer.TyperException as err:  # Typer's usage errors (and its own abort)
        _finishing.code = code = _usage_error(err, args, as_json)
    except (typer.Abort, KeyboardInterrupt):
        _finishing.code = code = 130  # first, so a second signal cannot interrupt the line
        report.print_error(InterruptError(None, "interrupted"), as_json)
    except Terminated:
        _finishing.code = code = 143
        report.print_error(TerminatedError(None, "terminated"), as_json)
    except BrokenPipeError:
        _finishing.code = code = 1
        _silence_stdout()
    except QtoolError as err:  # the report itself could not be written (stdout full, EIO)
        _finishing.code = code = 1
        _silence_stdout()
        report.print_error(err, as_json)
    except BaseException as err:  # a bug: one line, and the traceback only when asked for
        # BaseException: pyo3's PanicException (a Rust panic in tokenizers) derives from it
        if isinstance(err, (SystemExit, GeneratorExit)) or os.environ.get("QTOOL_DEBUG") == "1":
            raise
        _finishing.code = code = 1
        message = (
            f"internal error: {type(err).__name__}: {err}; re-run with QTOOL_DEBUG=1 for the "
            "traceback and report it"
        )
        report.print_error(InternalError(None, message), as_json)
    return code if isinstance(code, int) else 0


class _Finishing:
    """The exit code once the command is done (its outputs and report complete, or its error
    line chosen); None while it runs."""

    code: int | None = None
    ends_process = False  # main() is the process's entry (no argv given), not called in-process


_finishing = _Finishing()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """SIGTERM raises Terminated and SIGINT KeyboardInterrupt while the command runs, so that
    its outputs are cleaned up on the way out. Once it is done (its code chosen), a signal
    interrupts nothing: the process ends with the command's own code and nothing more."""
    code = _finishing.code
    if code is not None and _finishing.ends_process:
        _end_process(code)
    if signum == signal.SIGTERM:
        raise Terminated
    raise KeyboardInterrupt


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
