"""How `qtool COMMAND --help` reads: the options in panels (what to quantize, how, output,
quality gates, report), arguments without Typer's type tags, values in one metavar style, and
an epilog with an example and the environment variables that change the command.

Plain text through Typer's own formatter (the app sets rich_markup_mode=None): `--help` loads
no Rich. Typer draws `rich_help_panel` only with Rich, so Command groups the options itself.

Metavar style: a value is an upper-case word naming what it is (PATH, DIR, FILE, N, G, X, DB,
GLOB, FILE.png); a choice lists its values, `sym|asym`.
"""

from __future__ import annotations

import enum
import re
from typing import Any

from typer._click import core as click_core
from typer._click.formatting import HelpFormatter
from typer.core import TyperCommand, TyperGroup

# The commands in the order `qtool --help` lists them (the order of a session); a command not
# named here follows them in the order it registered.
COMMANDS = ("quantize", "dequantize", "compare", "eval", "calibrate", "inspect", "plot")

# The panels of the options, in the order --help shows them; an option without one is listed
# under OTHER (-h/--help).
INPUT = "Input"
SELECT = "What to quantize"
HOW = "How to quantize"
OUTPUT = "Output"
GATES = "Quality gates (exit 3 when one is broken)"
REPORT = "Report"
RUN = "Run"
OTHER = "Options"
PANELS = (INPUT, SELECT, HOW, OUTPUT, GATES, REPORT, RUN, OTHER)

KERNEL_ENV = (
    "QTOOL_KERNEL=auto|torch|fused: which CPU kernels quantize and dequantize (auto: the fused "
    "ones when numba is installed and the run's work, estimated per tensor and then measured, "
    "pays for loading them); every choice writes the same bytes."
)
DEBUG_ENV = "QTOOL_DEBUG=1: an error raises with its traceback instead of the one-line message."


def choices(kind: type[enum.Enum]) -> str:
    """The metavar of a choice option: its values, `sym|asym`."""
    return "|".join(str(member.value) for member in kind)


def epilog(example: str, *environment: str) -> str:
    """A command's epilog: one example, then the environment variables it reads (a paragraph
    each)."""
    return "\n\n".join([f"Example: {example}", *environment])


# A flag's hyphens while its text is wrapped: textwrap breaks words at hyphens ("--save-" /
# "logits" at a narrow terminal), never at this one; it is put back before the help is shown.
_WHOLE = "\u2011"
_FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")


def _keep_flags_whole(text: str) -> str:
    return _FLAG.sub(lambda m: m.group(0).replace("-", _WHOLE), text)


class Formatter(HelpFormatter):
    """Click's formatter, wrapping help text without breaking `--flag-names` at their hyphens."""

    def write_text(self, text: str) -> None:
        super().write_text(_keep_flags_whole(text))

    def write_dl(self, rows: Any, col_max: int = 30, col_spacing: int = 2) -> None:
        rows = [(first, _keep_flags_whole(second)) for first, second in rows]
        super().write_dl(rows, col_max, col_spacing)

    def getvalue(self) -> str:
        return super().getvalue().replace(_WHOLE, "-")


class Context(click_core.Context):
    formatter_class = Formatter


class Command(TyperCommand):
    """A qtool command's help: usage with INPUT (not Typer's {INPUT}), arguments by name alone,
    options in PANELS."""

    context_class = Context

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces: list[str] = super().collect_usage_pieces(ctx)
        pieces = [re.sub(r"^\{(.*)\}(\.\.\.)?$", r"\1\2", p) for p in pieces]  # {X}... -> X...
        # A metavar that says "several" itself (QUANT...) gets one ellipsis, not Click's second.
        return [re.sub(r"\.\.\.(\]?)\.\.\.$", r"\1...", p) for p in pieces]

    def format_options(self, ctx: Any, formatter: Any) -> None:
        arguments: list[tuple[str, str]] = []
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                name = param.metavar or (param.name or "").upper()
                arguments.append((name, record[1].replace("  [required]", "")))
            else:
                panel = getattr(param, "rich_help_panel", None) or OTHER
                panels.setdefault(panel, []).append(record)
        if arguments:
            with formatter.section("Arguments"):
                formatter.write_dl(arguments)
        for panel in sorted(panels, key=_panel_order):
            with formatter.section(panel):
                formatter.write_dl(panels[panel])


def _panel_order(panel: str) -> int:
    return PANELS.index(panel) if panel in PANELS else len(PANELS)


class Group(TyperGroup):
    """`qtool --help` lists the commands in COMMANDS order, whatever order they registered in."""

    context_class = Context

    def list_commands(self, ctx: Any) -> list[str]:
        names: list[str] = super().list_commands(ctx)
        return sorted(names, key=lambda n: COMMANDS.index(n) if n in COMMANDS else len(COMMANDS))
