"""Rendering: Rich tables for people, JSON for machines, one-line errors, a progress bar.

The only module that imports rich. Data goes to stdout, messages and progress to stderr. No
colour or escape codes unless the stream is a terminal (whatever FORCE_COLOR or CI variables
say), none at all with NO_COLOR, and names from files are shown with control characters escaped
so a tensor name cannot drive the terminal.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any, TypeVar

from rich import box
from rich.console import Console, Group
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from qtool.errors import OutputError, QtoolError
from qtool.gates import GateResult
from qtool.report.json import json_text
from qtool.results import (
    CompareRow,
    CompareSummary,
    DequantizeSummary,
    ErrorStats,
    InspectSummary,
    QuantizeRow,
    QuantizeSummary,
    Row,
    natural_key,
)

_SPARK = "▁▂▃▄▅▆▇█"


def console(stream: IO[str]) -> Console:
    """A console that emits escape codes only to a real terminal, and no colour under NO_COLOR."""
    tty = stream.isatty()
    no_color = bool(os.environ.get("NO_COLOR"))
    return Console(
        file=stream,
        force_terminal=tty,
        force_interactive=tty and os.environ.get("TERM") not in ("dumb", "unknown"),
        color_system="auto" if tty and not no_color else None,
        no_color=no_color,
        # Pipes and CI logs get a fixed width, so their output is the same everywhere.
        width=None if tty else _env_int("COLUMNS", 120),
        highlight=False,
        emoji=False,
        soft_wrap=False,
    )


def _env_int(name: str, default: int) -> int:
    try:
        return max(40, int(os.environ.get(name, "")))
    except ValueError:
        return default


def emit(stream: IO[str], *renderables: Any) -> None:
    """Print to a stream; off a terminal, without the padding Rich adds at line ends."""
    with _report_stream():
        _emit(stream, *renderables)


def _emit(stream: IO[str], *renderables: Any) -> None:
    con = console(stream)
    if con.is_terminal:
        for r in renderables:
            con.print(r)
        return
    # Off a terminal nothing wraps: a line as long as its longest name keeps logs greppable.
    unbounded = con.options.update_width(1 << 20)
    con.width = max([con.width, *(con.measure(r, options=unbounded).maximum for r in renderables)])
    with con.capture() as captured:
        for r in renderables:
            con.print(r)
    stream.write("\n".join(line.rstrip() for line in captured.get().splitlines()) + "\n")
    stream.flush()


def safe(text: str) -> str:
    """Show control and format characters (ESC, BEL, RTL overrides, ...) as escapes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


@contextmanager
def _report_stream() -> Iterator[None]:
    """A report that cannot be written (stdout on a full disk, closed, EIO) is a clear error."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as err:
        what = err.strerror or str(err)
        raise OutputError(
            "stdout", f"cannot write the report: {what} (any output files are complete)"
        ) from None


def print_json(doc: dict[str, Any]) -> None:
    """One JSON document on stdout, UTF-8 whatever the locale, no NaN/Infinity."""
    data = json_text(doc, indent=2) + "\n"
    with _report_stream():
        sys.stdout.buffer.write(data.encode("utf-8"))
        sys.stdout.flush()


def print_error(err: QtoolError | str, as_json: bool = False) -> None:
    """The one line (or JSON object) a failure prints, on stderr."""
    message = safe(str(err))
    if as_json:
        detail: dict[str, str | None] = {"message": message}
        if isinstance(err, QtoolError):
            detail |= {"code": err.code, "path": err.path, "tensor": err.tensor}
        doc = {"ok": False, "error": detail}
        sys.stderr.write(json_text(doc) + "\n")
        return
    line = Text.assemble(("qtool: error: ", "bold red"), message)
    console(sys.stderr).print(line, soft_wrap=True)


def print_line(message: str) -> None:
    """One plain line of output on stdout (control characters escaped)."""
    emit(sys.stdout, Text(safe(message)))


def print_note(message: str) -> None:
    """One informational line on stderr (stdout stays the report or the JSON)."""
    console(sys.stderr).print(Text.assemble("qtool: ", safe(message)), soft_wrap=True)


def print_warning(message: str) -> None:
    line = Text.assemble(("qtool: warning: ", "yellow"), safe(message))
    console(sys.stderr).print(line, soft_wrap=True)


# ---- numbers -----------------------------------------------------------------------------------


def _terminal_width() -> int | None:
    """The width a table must fit: a terminal's; None in a pipe or file, where lines may be
    long (every column kept, names never wrapped, so CI logs stay greppable)."""
    return console(sys.stdout).width if sys.stdout.isatty() else None


def _fmt_db(value: float) -> str:
    """'48.0 dB', or 'exact' for an exact reconstruction."""
    text = _fmt_sqnr(value)
    return text if text == "exact" else f"{text} dB"


def _fmt_sqnr(value: float) -> str:
    if value == math.inf:
        return "exact"
    return f"{value:.1f}" if math.isfinite(value) else str(value)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _spark(sqnr: float, lo: float = 0.0, hi: float = 60.0) -> str:
    """A bar of 8 levels: higher SQNR, taller bar; the worst layers stand out. Exact is a full
    bar; -inf (and NaN, which no report should carry) an empty one."""
    if sqnr == math.inf:
        return _SPARK[-1]
    if not math.isfinite(sqnr):
        return ""
    level = (min(max(sqnr, lo), hi) - lo) / (hi - lo)
    return _SPARK[min(len(_SPARK) - 1, int(level * len(_SPARK)))]


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# ---- ordering and gates ------------------------------------------------------------------------


R = TypeVar("R", bound=Row)


def arrange(rows: list[R], sort: str | None, top: int | None) -> list[R]:
    """File order unless asked: name in natural order (`layers.2` before `layers.10`), worst
    first for mse/sqnr, largest first for size. Rows without error figures sort after those
    with them."""
    if sort == "name":
        rows = sorted(rows, key=lambda r: natural_key(r.name))
    elif sort == "mse":
        rows = sorted(rows, key=lambda r: -r.errors.mse if r.errors else math.inf)
    elif sort == "sqnr":
        rows = sorted(rows, key=lambda r: r.errors.sqnr_db if r.errors else math.inf)
    elif sort == "size":
        rows = sorted(rows, key=lambda r: -r.size)
    return rows[:top] if top is not None else rows


def table_rows(
    rows: list[R], sort: str | None, top: int | None, limit: tuple[int, int] | None
) -> list[R]:
    """The rows a table shows: `arrange`'s, except that with `limit` (max rows, rows shown)
    and no `top`, a longer table shows its worst rows only (lowest SQNR first, unless sorted
    otherwise): 50,000 rows help nobody on a terminal, and Rich takes ~0.7 ms per row."""
    if limit is None or top is not None or len(rows) <= limit[0]:
        return arrange(rows, sort, top)
    return arrange(rows, sort or "sqnr", limit[1])


def _shown_line(shown: int, total: int) -> Text:
    return Text(f"(showing {shown} of {total} tensors; --all shows every one)", style="dim")


def _gate_text(result: GateResult | None) -> Text | None:
    if result is None or not result.gate.active:
        return None
    if result.passed:
        return Text("gate: passed", style="green")
    tensors = sorted(result.failed_tensors())
    shown = ", ".join(safe(t) for t in tensors[:5]) + (" ..." if len(tensors) > 5 else "")
    parts = [f"{len(tensors)} tensor(s) out of bounds: {shown}"] if tensors else []
    if any(v.tensor is None for v in result.violations):
        parts.append(f"overall SQNR below {result.gate.min_overall_sqnr} dB")
    return Text("gate: FAILED (" + "; ".join(parts) + ")", style="bold red")


# ---- quantize ----------------------------------------------------------------------------------


NARROW = 110  # below this terminal width, the shape and max-error columns are left out

Cell = Callable[[Row], "str | Text"]


def quantize_table(
    rows: Sequence[Row],
    title: str,
    failed: set[str] | None = None,
    *,
    width: int | None = None,
    headers: tuple[str, str] = ("dtype", "quantization"),
) -> Group:
    """One row per tensor under a title line; `failed` (when a gate is set) adds a gate column."""
    wide = width is None or width >= NARROW
    right = {"justify": "right", "no_wrap": True}
    columns: list[tuple[str, dict[str, Any], Cell]] = [
        ("tensor", {"overflow": "fold", "min_width": 12}, lambda r: Text(safe(r.name))),
        ("shape", {"no_wrap": True}, lambda r: _shape(r.shape)),
        (headers[0], {"no_wrap": True}, _dtype_cell),
        (headers[1], {"no_wrap": wide, "overflow": "fold"}, _action_cell),
        ("MSE", right, lambda r: f"{r.errors.mse:.3g}" if r.errors else ""),
        ("max err", right, lambda r: f"{r.errors.max_abs:.3g}" if r.errors else ""),
        ("SQNR dB", right, lambda r: _fmt_sqnr(r.errors.sqnr_db) if r.errors else ""),
        ("", {"no_wrap": True}, lambda r: _spark(r.errors.sqnr_db) if r.errors else ""),
    ]
    if any(r.errors is not None and r.errors.mse_gain is not None for r in rows):
        columns.insert(7, ("vs minmax", right, lambda r: _fmt_gain(r.errors)))
    if not wide:
        columns = [c for c in columns if c[0] not in ("shape", "max err")]
    if not any(r.errors for r in rows):  # a plan without --estimate: no figures to show
        columns = [c for c in columns if c[0] not in ("MSE", "max err", "SQNR dB", "")]
    if failed is not None:
        columns.append(("gate", {"no_wrap": True}, lambda r: _gate_cell(r, failed)))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for header, options, _ in columns:
        table.add_column(header, **options)
    for r in rows:
        table.add_row(*(cell(r) for _, _, cell in columns))
    return Group(Text(title), table)  # a title line of its own: never wrapped to the table


def _fmt_gain(stats: ErrorStats | None) -> str:
    """The squared error against min-max's, as a percentage: '-8.2 %'."""
    gain = stats.mse_gain if stats is not None else None
    return "" if gain is None else f"{gain * 100:+.1f} %"


def _dtype_cell(r: Row) -> str:
    a, b = r.dtypes
    return f"{a}→{b}" if a != b else a


def _action_cell(r: Row) -> Text:
    return Text(safe(r.detail), style="dim" if r.dimmed else "")


def _gate_cell(r: Row, failed: set[str]) -> str | Text:
    if r.name in failed:
        return Text("FAIL", "bold red")
    return "ok" if r.errors else ""


def print_quantize(
    summary: QuantizeSummary, rows: list[QuantizeRow] | None = None, gate: GateResult | None = None
) -> None:
    title = "Plan (dry run, nothing written)" if summary.dry_run else "Quantization report"
    if summary.overall is not None:
        title += f"; errors {summary.measured}"
    failed = gate.failed_tensors() if gate is not None and gate.gate.active else None
    shown = summary.rows if rows is None else rows
    table = quantize_table(shown, title, failed, width=_terminal_width())
    lines: list[Any] = [table, Text(_quantize_totals(summary))]
    if len(shown) < len(summary.rows):
        lines.append(_shown_line(len(shown), len(summary.rows)))
    verb = "would write " if summary.dry_run else "wrote "
    lines.append(Text(verb + ", ".join(safe(p) for p in summary.outputs)))
    gate_line = _gate_text(gate)
    if gate_line is not None:
        lines.append(gate_line)
    emit(sys.stdout, *lines)
    for name in summary.skipped[:1]:
        print_warning(f"skipped {len(summary.skipped)} non-tensor entries (e.g. {name!r})")


def _quantize_totals(summary: QuantizeSummary) -> str:
    n, q = len(summary.rows), len(summary.quantized)
    ratio = summary.bytes_in / summary.bytes_out if summary.bytes_out else 0.0
    spec = "specs per tensor" if summary.per_tensor_specs else summary.spec.describe()
    parts = [
        f"{q} of {n} tensors quantized ({spec}), {n - q} kept",
        f"{_fmt_bytes(summary.bytes_in)} → {_fmt_bytes(summary.bytes_out)} ({ratio:.2f}x)",
    ]
    overall = summary.overall
    if overall is not None:
        parts.append(f"overall SQNR {_fmt_db(overall.sqnr_db)} ({_pooled(summary.pooled_over)})")
    if overall is not None and overall.mse_gain is not None:
        parts.append(f"mse range search: {_fmt_gain(overall)} squared error vs minmax")
    if summary.budget_sizes is not None:
        int8, flt = summary.budget_sizes
        parts.append(
            f"budget: {_fmt_bytes(summary.bytes_out)} vs all-int8 {_fmt_bytes(int8)}, "
            f"all-float {_fmt_bytes(flt)}"
        )
    return " · ".join(parts)


def _pooled(pooled_over: str) -> str:
    """What an overall SQNR pools, for the summary line."""
    return "quantized tensors" if pooled_over == "quantized" else "all compared tensors"


# ---- compare -----------------------------------------------------------------------------------


def print_compare(summary: CompareSummary, rows: list[CompareRow], gate: GateResult | None) -> None:
    failed = gate.failed_tensors() if gate is not None and gate.gate.active else None
    title = f"{safe(summary.inputs[0])} (A) vs {safe(summary.inputs[1])} (B)"
    if summary.overall is not None:
        title += f"; errors {summary.measured}"
    width = _terminal_width()
    table = quantize_table(rows, title, failed, width=width, headers=("dtype A→B", "compared"))
    overall = summary.overall
    totals = (
        f"{len(summary.compared)} of {len(summary.rows)} tensors compared, "
        f"{len(summary.mismatches)} mismatched"
    )
    if overall is not None:
        totals += f" · overall SQNR {_fmt_db(overall.sqnr_db)} ({_pooled(summary.pooled_over)})"
    lines: list[Any] = [table, Text(totals)]
    if len(rows) < len(summary.rows):
        lines.append(_shown_line(len(rows), len(summary.rows)))
    gate_line = _gate_text(gate)
    if gate_line is not None:
        lines.append(gate_line)
    emit(sys.stdout, *lines)


# ---- dequantize --------------------------------------------------------------------------------


def print_dequantize(summary: DequantizeSummary) -> None:
    restored = sum(r.restored for r in summary.rows)
    total = sum(r.bytes_out for r in summary.rows)
    emit(
        sys.stdout,
        Text(
            f"dequantized {restored} of {len(summary.rows)} tensors "
            f"({len(summary.rows) - restored} copied byte for byte), {_fmt_bytes(total)}; "
            "wrote " + ", ".join(safe(p) for p in summary.outputs)
        ),
    )


# ---- plot --------------------------------------------------------------------------------------


def print_inspect(summary: InspectSummary) -> None:
    quantized = any(r.qinfo for r in summary.rows)
    shards = f"{summary.shards} shard{'s' if summary.shards != 1 else ''}"
    kind = f"{summary.kind}, {shards}" if summary.shards else summary.kind
    title = f"{safe(summary.path)} ({kind})"
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("tensor", overflow="fold", min_width=12)
    table.add_column("dtype", no_wrap=True)
    table.add_column("shape", overflow="fold")
    table.add_column("elements", justify="right", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    if quantized:
        table.add_column("quantization", overflow="fold")
    for r in summary.rows:
        cells: list[str | Text] = [
            Text(safe(r.name)),
            r.dtype,
            _shape(r.shape),
            f"{r.numel:,}",
            _fmt_bytes(r.nbytes),
        ]
        if quantized:
            cells.append(_qinfo_text(r.qinfo))
        table.add_row(*cells)
    lines: list[Any] = [
        Text(title),
        table,
        Text(
            f"{len(summary.rows)} tensors, {summary.total_numel:,} elements, "
            f"{_fmt_bytes(summary.total_bytes)}"
        ),
    ]
    if summary.metadata:
        lines.append(Text("metadata: " + safe(json.dumps(summary.metadata, ensure_ascii=False))))
    if summary.manifest:
        lines.append(Text(_manifest_text(summary.manifest)))
    if summary.quantized_modules is not None:
        ignore = ", ".join(summary.ignore or []) or "none"
        lines.append(
            Text(f"{summary.quantized_modules} quantized modules; ignore (kept float): {ignore}")
        )
    emit(sys.stdout, *lines)
    for note in summary.notes:
        print_warning(note)


def _qinfo_text(qinfo: dict[str, object] | None) -> str:
    if not qinfo:
        return ""
    text = f"{spec_label(qinfo)} ({qinfo['orig_dtype']})"
    if "scale_min" in qinfo:
        lo, hi = qinfo["scale_min"], qinfo["scale_max"]
        text += f" scale {lo:.2g}" if lo == hi else f" scale {lo:.2g}..{hi:.2g}"
    return text


def spec_label(spec: dict[str, object]) -> str:
    """'sym int4 group 128 mse' from a spec's JSON form (QSpec.to_json)."""
    g = spec.get("granularity")
    where = "tensor"
    if isinstance(g, dict) and g.get("kind") == "channel":
        where = f"axis {g.get('axis')}"
    elif isinstance(g, dict) and g.get("kind") == "group":
        where = f"group {g.get('size')}"
    label = f"{spec.get('scheme')} {spec.get('dtype')} {where}"
    return label + (" mse" if spec.get("range_method") == "mse" else "")


def _manifest_text(manifest: dict[str, object]) -> str:
    tensors = manifest.get("tensors", {})
    count = len(tensors) if isinstance(tensors, dict) else 0
    return (
        f"manifest: {manifest.get('format')} v{manifest.get('format_version')}, "
        f"semantics {manifest.get('semantics')!r}, qtool {manifest.get('qtool_version')}, "
        f"for {safe(str(manifest.get('quantized_file')))}, {count} quantized tensors"
    )


# ---- progress ----------------------------------------------------------------------------------


class _BarProgress:
    """Tensors and bytes done, throughput and time left, on stderr."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._task = progress.add_task("", total=None)

    def start(self, total_bytes: int) -> None:
        self._progress.update(self._task, total=total_bytes)

    def advance(self, name: str, nbytes: int) -> None:
        self._progress.update(self._task, advance=nbytes, description=safe(name)[-40:])


@contextmanager
def progress_bar() -> Iterator[_BarProgress | None]:
    """A transient bar while stderr is an interactive terminal; None (nothing at all) otherwise."""
    err = console(sys.stderr)
    if not err.is_interactive:
        yield None
        return
    columns = (
        TextColumn("{task.description}", style="dim"),
        BarColumn(),
        TaskProgressColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err, transient=True) as progress:
        yield _BarProgress(progress)
