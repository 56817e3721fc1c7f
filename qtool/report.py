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
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from rich import box
from rich.console import Console
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
from qtool.summary import (
    CompareSummary,
    DequantizeSummary,
    ErrorStats,
    InspectSummary,
    QuantizeSummary,
    TensorRow,
)

SCHEMA_VERSION = 1
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


def json_text(doc: object, indent: int | None = None) -> str:
    """JSON, UTF-8 safe: lone surrogates (undecodable bytes of a file name) become \\uDCxx
    escapes, which Python's json reads back to the same name, instead of failing to encode."""
    text = json.dumps(doc, indent=indent, ensure_ascii=False, allow_nan=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


_SURROGATE = re.compile("[\ud800-\udfff]")


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


def print_warning(message: str) -> None:
    line = Text.assemble(("qtool: warning: ", "yellow"), safe(message))
    console(sys.stderr).print(line, soft_wrap=True)


# ---- numbers -----------------------------------------------------------------------------------


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _fmt_sqnr(value: float) -> str:
    return "exact" if value == math.inf else f"{value:.1f}"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _spark(sqnr: float, lo: float = 0.0, hi: float = 60.0) -> str:
    """A bar of 8 levels: higher SQNR, taller bar; the worst layers stand out."""
    if not math.isfinite(sqnr):
        return _SPARK[-1]
    level = (min(max(sqnr, lo), hi) - lo) / (hi - lo)
    return _SPARK[min(len(_SPARK) - 1, int(level * len(_SPARK)))]


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# ---- ordering and gates ------------------------------------------------------------------------

SORT_KEYS = ("name", "mse", "sqnr", "size")


def arrange(rows: list[TensorRow], sort: str | None, top: int | None) -> list[TensorRow]:
    """File order unless asked: name ascending, worst first for mse/sqnr, largest first for size.
    Rows without error figures sort after those with them."""
    if sort == "name":
        rows = sorted(rows, key=lambda r: r.name)
    elif sort == "mse":
        rows = sorted(rows, key=lambda r: -r.errors.mse if r.errors else math.inf)
    elif sort == "sqnr":
        rows = sorted(rows, key=lambda r: r.errors.sqnr_db if r.errors else math.inf)
    elif sort == "size":
        rows = sorted(rows, key=lambda r: -r.bytes_in)
    return rows[:top] if top is not None else rows


def gate_json(result: GateResult | None) -> dict[str, Any] | None:
    if result is None or not result.gate.active:
        return None
    g = result.gate
    return {
        "passed": result.passed,
        "bounds": {
            "max_mse": g.max_mse,
            "min_sqnr_db": g.min_sqnr,
            "min_overall_sqnr_db": g.min_overall_sqnr,
        },
        "violations": [
            {
                "tensor": v.tensor,
                "metric": v.metric,
                "value": None if v.value is None else _finite_or_none(v.value),
                "bound": v.bound,
                "detail": v.detail,
            }
            for v in result.violations
        ],
    }


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


def error_json(stats: ErrorStats | None) -> dict[str, float | None]:
    if stats is None:
        return {"mse": None, "max_abs_error": None, "sqnr_db": None}
    return {
        "mse": stats.mse,
        "max_abs_error": stats.max_abs,
        "sqnr_db": _finite_or_none(stats.sqnr_db),
    }


def quantize_json(
    summary: QuantizeSummary,
    rows: list[TensorRow] | None = None,
    gate: GateResult | None = None,
) -> dict[str, Any]:
    tensors = []
    for r in summary.rows if rows is None else rows:
        item: dict[str, Any] = {
            "name": r.name,
            "shape": list(r.shape),
            "dtype": r.dtype,
            "out_dtype": r.out_dtype,
            "quantized": r.quantized,
            "detail": r.detail,
            "bytes_in": r.bytes_in,
            "bytes_out": r.bytes_out,
            **error_json(r.errors),
        }
        if r.scale_range is not None:
            item["scale_min"], item["scale_max"] = r.scale_range
        tensors.append(item)
    quantized = summary.quantized
    return {
        "schema_version": SCHEMA_VERSION,
        "command": "quantize",
        "dry_run": summary.dry_run,
        "inputs": summary.inputs,
        "outputs": summary.outputs,
        "spec": summary.spec,
        "device": summary.device,
        "tensors": tensors,
        "totals": {
            "tensors": len(summary.rows),
            "quantized": len(quantized),
            "kept": len(summary.rows) - len(quantized),
            "bytes_in": summary.bytes_in,
            "bytes_out": summary.bytes_out,
            "compression": summary.bytes_in / summary.bytes_out if summary.bytes_out else None,
            **error_json(summary.overall),
        },
        "skipped_non_tensors": summary.skipped,
        "gate": gate_json(gate),
    }


NARROW = 110  # below this terminal width, the shape and max-error columns are left out

Cell = Callable[[TensorRow], "str | Text"]


def quantize_table(
    rows: list[TensorRow],
    title: str,
    failed: set[str] | None = None,
    *,
    width: int | None = None,
    headers: tuple[str, str] = ("dtype", "quantization"),
) -> Table:
    """One row per tensor; `failed` (when a gate is set) adds a gate column."""
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
    if not wide:
        columns = [c for c in columns if c[0] not in ("shape", "max err")]
    if failed is not None:
        columns.append(("gate", {"no_wrap": True}, lambda r: _gate_cell(r, failed)))
    table = Table(title=Text(title), title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for header, options, _ in columns:
        table.add_column(header, **options)
    for r in rows:
        table.add_row(*(cell(r) for _, _, cell in columns))
    return table


def _dtype_cell(r: TensorRow) -> str:
    return f"{r.dtype}→{r.out_dtype}" if r.dtype != r.out_dtype else r.dtype


def _action_cell(r: TensorRow) -> Text:
    return Text(safe(r.detail), style="" if r.quantized else "dim")


def _gate_cell(r: TensorRow, failed: set[str]) -> str | Text:
    if r.name in failed:
        return Text("FAIL", "bold red")
    return "ok" if r.errors else ""


def print_quantize(
    summary: QuantizeSummary, rows: list[TensorRow] | None = None, gate: GateResult | None = None
) -> None:
    title = "Plan (dry run, nothing written)" if summary.dry_run else "Quantization report"
    failed = gate.failed_tensors() if gate is not None and gate.gate.active else None
    shown = summary.rows if rows is None else rows
    table = quantize_table(shown, title, failed, width=console(sys.stdout).width)
    lines: list[Any] = [table, Text(_quantize_totals(summary))]
    if len(shown) < len(summary.rows):
        lines.append(Text(f"(showing {len(shown)} of {len(summary.rows)} tensors)", style="dim"))
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
    parts = [
        f"{q} of {n} tensors quantized ({summary.spec}), {n - q} kept",
        f"{_fmt_bytes(summary.bytes_in)} → {_fmt_bytes(summary.bytes_out)} ({ratio:.2f}x)",
    ]
    overall = summary.overall
    if overall is not None:
        parts.append(f"overall SQNR {_fmt_sqnr(overall.sqnr_db)} dB")
    return " · ".join(parts)


# ---- compare -----------------------------------------------------------------------------------


def compare_json(
    summary: CompareSummary, rows: list[TensorRow], gate: GateResult | None
) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "command": "compare",
        "inputs": summary.inputs,
        "tensors": [
            {
                "name": r.name,
                "shape": list(r.shape),
                "dtype_a": r.dtype,
                "dtype_b": r.out_dtype,
                "compared": r.errors is not None,
                "mismatch": r.mismatch,
                "detail": r.detail,
                **error_json(r.errors),
            }
            for r in rows
        ],
        "totals": {
            "tensors": len(summary.rows),
            "compared": len(summary.compared),
            "mismatches": len(summary.mismatches),
            **error_json(summary.overall),
        },
        "gate": gate_json(gate),
    }


def print_compare(summary: CompareSummary, rows: list[TensorRow], gate: GateResult | None) -> None:
    failed = gate.failed_tensors() if gate is not None and gate.gate.active else None
    title = f"{safe(summary.inputs[0])} (A) vs {safe(summary.inputs[1])} (B)"
    width = console(sys.stdout).width
    table = quantize_table(rows, title, failed, width=width, headers=("dtype A→B", "compared"))
    overall = summary.overall
    totals = (
        f"{len(summary.compared)} of {len(summary.rows)} tensors compared, "
        f"{len(summary.mismatches)} mismatched"
    )
    if overall is not None:
        totals += f" · overall SQNR {_fmt_sqnr(overall.sqnr_db)} dB"
    lines: list[Any] = [table, Text(totals)]
    gate_line = _gate_text(gate)
    if gate_line is not None:
        lines.append(gate_line)
    emit(sys.stdout, *lines)


# ---- dequantize --------------------------------------------------------------------------------


def dequantize_json(summary: DequantizeSummary) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "command": "dequantize",
        "inputs": summary.inputs,
        "sidecars": summary.sidecars,
        "outputs": summary.outputs,
        "tensors": [
            {
                "name": r.name,
                "shape": list(r.shape),
                "dtype": r.dtype,
                "restored": r.restored,
                "bytes": r.bytes_out,
            }
            for r in summary.rows
        ],
    }


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


# ---- inspect -----------------------------------------------------------------------------------


def inspect_json(summary: InspectSummary) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "command": "inspect",
        "path": summary.path,
        "kind": summary.kind,
        "shards": summary.shards,
        "tensors": [
            {
                "name": r.name,
                "dtype": r.dtype,
                "shape": list(r.shape),
                "numel": r.numel,
                "bytes": r.nbytes,
                **({"quantization": r.qinfo} if r.qinfo else {}),
            }
            for r in summary.rows
        ],
        "totals": {
            "tensors": len(summary.rows),
            "numel": summary.total_numel,
            "bytes": summary.total_bytes,
        },
        "metadata": summary.metadata,
        "manifest": summary.manifest,
        "notes": summary.notes,
    }


def print_inspect(summary: InspectSummary) -> None:
    quantized = any(r.qinfo for r in summary.rows)
    kind = f"{summary.kind}, {summary.shards} shards" if summary.shards else summary.kind
    title = f"{safe(summary.path)} ({kind})"
    table = Table(title=Text(title), title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
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
    emit(sys.stdout, *lines)
    for note in summary.notes:
        print_warning(note)


def _qinfo_text(qinfo: dict[str, object] | None) -> str:
    if not qinfo:
        return ""
    where = "tensor" if qinfo["axis"] is None else f"axis {qinfo['axis']}"
    text = f"{qinfo['scheme']} {qinfo['dtype']} {where} ({qinfo['orig_dtype']})"
    if "scale_min" in qinfo:
        lo, hi = qinfo["scale_min"], qinfo["scale_max"]
        text += f" scale {lo:.2g}" if lo == hi else f" scale {lo:.2g}..{hi:.2g}"
    return text


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
