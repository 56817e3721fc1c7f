"""Failures as the command line shows them: qtool's errors with their hints spelled as options,
interruptions that say what was written, and Typer's usage errors in qtool's words (one line:
what is wrong, and what to type instead)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import typer

from qtool.cli.lazy import api, report
from qtool.cli.suggest import suggestion, value_after
from qtool.errors import InterruptError, QtoolError, TerminatedError, UsageError


class Terminated(BaseException):
    """SIGTERM, raised where the process is so that outputs are cleaned up on the way out."""


@dataclass
class RunState:
    """What a command has done so far, so that an interruption reports it truthfully."""

    written: list[str] = field(default_factory=list)


@contextmanager
def user_errors(as_json: bool) -> Iterator[RunState]:
    """Expected failures become one line on stderr and exit code 1 (2 for usage), with no
    traceback; an interruption says truthfully what was already written."""
    run = RunState()
    try:
        with api.one_command():  # the output names this command reserves end with it
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


def _stopped(what: str, run: RunState) -> str:
    if run.written:
        return (
            f"{what} after {', '.join(run.written)} were written (complete); the rest was not done"
        )
    return f"{what}; no output was written"


# How the command line spells what the engine's hints ask of the user.
OPTION_HINTS = {
    "allow-requantize": "or pass --allow-requantize to quantize it again",
    "axis": "--axis N",
    "check-text": "--check-text FILE",
    "config": "--config PATH",
    "device": "--device cpu",
    "dtype": "--dtype int8|int4",
    "estimate": "--estimate",
    "exclude": "--exclude NAME",
    "force": "pass --force",
    "group-fallback": "--group-fallback channel|keep",
    "keep-nonfinite": "--keep-nonfinite",
    "qparams": "--qparams PATH",
    "no-sensitivity": "qtool calibrate without --sensitivity, then --imatrix FILE",
    "restore-dtype": "--to float32",
    "sensitivity": "qtool calibrate --sensitivity, then --imatrix FILE; or --target-size",
    "text": "--text FILE",
    "tokens": "--tokens N",
}


def with_option_names(err: QtoolError) -> QtoolError:
    """The error with its hints spelled as this command line's options, e.g. `(pass --force)`;
    not those the message spells already."""
    spelled = [OPTION_HINTS[h] for h in err.hints if h in OPTION_HINTS]
    names = [name for name in spelled if name not in err.message]
    if not names:
        return err
    rendered = type(err).__new__(type(err))  # (copy.copy would re-run __init__ with args)
    rendered.__dict__.update(err.__dict__, message=f"{err.message} ({'; '.join(names)})")
    return rendered


# ---- Typer's usage errors ---------------------------------------------------------------------


def usage_line(err: typer.TyperException, args: Sequence[str]) -> str:
    """A usage error of Typer's as one line: an unknown option with what was probably meant, a
    missing argument with the usage, anything else in plain words."""
    ctx: Any = getattr(err, "ctx", None)
    option = getattr(err, "option_name", None)
    if option is not None and hasattr(err, "possibilities"):
        offered = _offered(ctx)
        meant = suggestion(option, value_after(args, option), offered)
        hint = f"did you mean {meant}?" if meant else f"see {_command(ctx)} --help"
        return f"no such option: {option}; {hint}"
    text = usage_message(err.format_message())
    if hasattr(err, "param_type") and ctx is not None:  # a missing argument or option
        usage = ctx.get_usage().removeprefix("Usage: ")
        return f"{text}; usage: {usage} (see {_command(ctx)} --help)"
    return text


def _offered(ctx: Any) -> list[str]:
    """The long and short options of the command that failed, hidden ones left out."""
    params = ctx.command.params if ctx is not None else []
    return [o for p in params if not getattr(p, "hidden", False) for o in p.opts + p.secondary_opts]


def _command(ctx: Any) -> str:
    return str(ctx.command_path) if ctx is not None else "qtool"


def usage_message(text: str) -> str:
    """Typer's wording, one line: "Invalid value for '--scheme': Value error, 'foo' is not one
    of 'sym', 'asym'." -> "--scheme: 'foo' is not one of sym, asym"."""
    text = re.sub(r"^Invalid value for (.+?): ", lambda m: m[1].replace("'", "") + ": ", text)
    for pattern, plain in _PLAIN_WORDING:
        text = re.sub(pattern, plain, text)
    return " ".join(text.split()).rstrip(".")


def _missing(m: re.Match[str]) -> str:
    """Click's "Missing option '--tensor' / '-t'" -> "missing option --tensor (-t)"."""
    return f"missing {m[1]} {m[2]}" + (f" ({m[3]})" if m[3] else "")


_PLAIN_WORDING = (  # pydantic's and Click's phrases, as Typer passes them on, in a CLI's words
    (r"(Value|Input) error, ", ""),
    (r"is not one of (.+?)\.?$", lambda m: "is not one of " + m[1].replace("'", "")),
    (r"Input should be greater than or equal to (\S+)", r"must be at least \1"),
    (r"Input should be less than or equal to (\S+)", r"must be at most \1"),
    (r"Input should be a valid integer.*", "expects a whole number"),
    (r"Input should be a valid number.*", "expects a number"),
    (r"^Missing (argument|option) '([^']+)'(?: / '([^']+)')?", _missing),
)
