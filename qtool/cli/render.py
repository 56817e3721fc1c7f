"""What the commands share after the work: the rows in the order and number asked for (--sort,
--top, --all), as a table or JSON, then the gate's exit code; notes and --plot's file name."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import typer

from qtool.cli import options
from qtool.cli.lazy import api, report

if TYPE_CHECKING:
    from qtool.gates import GateResult
    from qtool.results import Progress, Row

GATE_FAILED = 3

R = TypeVar("R", bound="Row")


@dataclass(frozen=True)
class Shown:
    """Which rows to show: --sort, --top and --all (which overrides --top)."""

    sort: options.SortKey | None
    top: int | None
    every: bool

    def rows(self, rows: list[R], as_json: bool) -> list[R]:
        """JSON carries every row (or --top's); a long table only its worst (see --all)."""
        sort = self.sort.value if self.sort else None
        top = None if self.every else self.top
        if as_json:
            return report.arrange(rows, sort, top)
        limit = None if self.every else (options.TABLE_MAX_ROWS, options.TRIMMED_ROWS)
        return report.table_rows(rows, sort, top, limit)


def show_and_gate(
    rows: list[R],
    shown: Shown,
    gate: GateResult,
    as_json: bool,
    as_document: Callable[[list[R]], None],
    as_table: Callable[[list[R]], None],
) -> None:
    """Render the rows `shown` asks for as JSON or a table, then exit 3 if a gate failed."""
    (as_document if as_json else as_table)(shown.rows(rows, as_json))
    if not gate.passed:
        raise typer.Exit(GATE_FAILED)


def plot_target(plot: Path | None, src: Path, command: str) -> Path | None:
    """--plot names a .png file (or an existing directory for the default name)."""
    if plot is None:
        return None
    default = src.with_name(f"{src.stem}.{command}.png")
    return api.output_path(plot, default, (".png",), "--plot", flag="--plot")


def print_notes(notes: list[str]) -> None:
    for note in notes:
        report.print_warning(note)


@contextmanager
def shown_progress(as_json: bool) -> Iterator[Progress | None]:
    """quantize's progress bar (bytes, the tensor, time left) on stderr while it is a terminal;
    None, nothing shown, on a pipe or under --json."""
    if as_json:
        yield None
        return
    with report.progress_bar() as bar:
        yield bar
