"""The `qtool` program around its commands (cli/commands.py): the Typer app, the entry point,
signals, exit codes and the mapping of errors to one line.

Exit codes: 0 success, 1 a clear error, 2 a usage error, 3 a quality gate failed (outputs are
still written), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM). Only cli/ imports typer.
Torch, Rich and the engine are loaded only when a command needs them (lazy_module), so
`qtool --help` and `qtool inspect model.safetensors` answer at once.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import re
import signal
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from typer.core import TyperCommand

from qtool import __version__
from qtool.errors import (
    InternalError,
    InterruptError,
    QtoolError,
    TerminatedError,
    UsageError,
)


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
    from qtool.report import console as report
else:
    report = lazy_module("qtool.report.console")


class Command(TyperCommand):
    """Usage lines show arguments as INPUT, not Typer's {INPUT}."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces: list[str] = super().collect_usage_pieces(ctx)
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


app = typer.Typer(  # its commands are cli/commands.py, registered when qtool.cli is imported
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
