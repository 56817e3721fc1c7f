"""Rendering: tables for people, JSON for machines, one-line errors, a progress bar.

The only module that imports rich. Tables and summaries are laid out once, as plain lines, for
the width of the terminal or, off a terminal, of COLUMNS (report/layout.py); a terminal gets
them through Rich with their styles, a pipe as plain text. Data goes to stdout, messages and
progress to stderr. No colour or escape codes unless the stream is a terminal (whatever
FORCE_COLOR or CI variables say), none at all with NO_COLOR, and names from files are shown with
control characters escaped so a tensor name cannot drive the terminal.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any, TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from qtool.calibration import Role
from qtool.errors import OutputError, QtoolError
from qtool.gates import GateResult, kl_where
from qtool.report import layout
from qtool.report.json import json_text
from qtool.report.layout import Column, Line
from qtool.results import (
    CompareRow,
    CompareSummary,
    DequantizeSummary,
    ErrorStats,
    InspectSummary,
    ModelKL,
    QuantizeRow,
    QuantizeSummary,
    Row,
    WeightedError,
    natural_key,
)
from qtool.spec import Codec

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


def width_of(stream: IO[str]) -> int:
    """The width output to `stream` is laid out for: a terminal's own, else COLUMNS (120)."""
    return console(stream).width


def emit(stream: IO[str], lines: Sequence[Line]) -> None:
    """Print laid-out lines: styled on a terminal, plain text (no trailing spaces) elsewhere."""
    with _report_stream():
        if stream.isatty():
            text = Text("\n").join(Text.assemble(*line) for line in lines)
            console(stream).print(text, soft_wrap=True)
            return
        stream.write("".join("".join(t for t, _ in line).rstrip() + "\n" for line in lines))
        stream.flush()


def _plain(texts: Sequence[str], style: str = "") -> list[Line]:
    return [[(t, style)] for t in texts]


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
    """One line of output on stdout (control characters escaped; wrapped at its spaces when
    it is wider than the output)."""
    emit(sys.stdout, _plain(layout.phrases([safe(message)], width_of(sys.stdout))))


IGNORE_SHOWN = 4
"""Module names the ignore line shows; the JSON's `ignore` lists them all."""


def ignore_note(names: Sequence[str]) -> str:
    """The Linear layers an export keeps in float, in one short line: every name when there
    are few, else their count and the first IGNORE_SHOWN (a model of 211 names a screenful)."""
    head = "ignore (Linear layers kept in float): "
    if len(names) <= IGNORE_SHOWN:
        return head + ", ".join(names)
    first = ", ".join(names[:IGNORE_SHOWN])
    more = len(names) - IGNORE_SHOWN
    return f"{head}{len(names):,} layers: {first} and {more:,} more (--json lists them all)"


def print_note(message: str) -> None:
    """One informational line on stderr (stdout stays the report or the JSON)."""
    console(sys.stderr).print(Text.assemble("qtool: ", safe(message)), soft_wrap=True)


def print_warning(message: str) -> None:
    line = Text.assemble(("qtool: warning: ", "yellow"), safe(message))
    console(sys.stderr).print(line, soft_wrap=True)


# ---- numbers -----------------------------------------------------------------------------------


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
    """Name in natural order (`layers.2` before `layers.10`, as inspect lists them) unless asked
    otherwise: worst first for mse/sqnr, largest first for size. Rows without error figures
    sort after those with them. `top` without a sort keeps the worst rows: the first N in
    name order would be whatever tensors the file happens to start with."""
    if sort is None and top is not None:
        sort = "sqnr"
    if sort in (None, "name"):
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


def _shown_line(shown: int, total: int) -> str:
    return f"(showing {shown} of {total} tensors; --all shows every one)"


def _hidden_line(hidden: list[str], stream: IO[str]) -> str:
    """The note that says which columns a narrow output hid, and how to see them."""
    width = width_of(stream)
    article = "an" if str(width).startswith("8") else "a"  # an 80-column, a 100-column
    terminal = f"{article} {width}-column terminal"
    where = terminal if stream.isatty() else f"{width} columns (COLUMNS)"
    how = "widen the terminal" if stream.isatty() else "set COLUMNS wider"
    return f"({', '.join(hidden)} hidden to fit {where}; {how}, or use --json)"


def _notes(lines: list[Line], width: int, *notes: str | None) -> None:
    for note in notes:
        if note is not None:
            lines += _plain(layout.phrases([note], width), "dim")


def _gate_lines(
    result: GateResult | None, width: int, model_kl: Sequence[ModelKL] = ()
) -> list[Line]:
    if result is None or not result.gate.active:
        return []
    if result.passed:
        bound = result.gate.max_kl_ratio
        ratios = [f"{k.ratio:.3g}x on the {kl_where(k.stream)}" for k in model_kl]
        if bound is None or not ratios:
            return _plain(["gate: passed"], "green")
        text = (f"gate: passed (model KL {', '.join(ratios)} round to nearest's; "
                f"bound {bound:g}x)")  # fmt: skip
        return _plain(layout.phrases([text], width), "green")
    tensors = sorted(result.failed_tensors())
    shown = ", ".join(safe(t) for t in tensors[:5]) + (" ..." if len(tensors) > 5 else "")
    parts = [f"{len(tensors)} tensor(s) out of bounds: {shown}"] if tensors else []
    if any(v.metric == "overall_sqnr_db" for v in result.violations):
        parts.append(f"overall SQNR below {result.gate.min_overall_sqnr} dB")
    parts += [v.detail for v in result.violations if v.metric == "model_kl_ratio"]
    text = "gate: FAILED (" + "; ".join(parts) + ")"
    return _plain(layout.phrases([text], width), "bold red")


# ---- quantize ----------------------------------------------------------------------------------


Cell = Callable[[Row], "tuple[str, str]"]


def quantize_columns(
    rows: Sequence[Row],
    failed: set[str] | None = None,
    headers: tuple[str, str] = ("dtype", "quantization"),
    fold_names: bool = True,
) -> list[Column]:
    """One column per figure, a cell per row; a gate column when a gate is set (`failed`).
    Too narrow an output hides shape, then max err, MSE, the SQNR bar and vs minmax, then
    folds the quantization column, and the names only where `fold_names` (a terminal: piped
    names stay whole, so logs stay greppable)."""

    def column(header: str, cell: Cell, **how: Any) -> Column:
        return Column(header, [cell(r) for r in rows], **how)

    def figure(fmt: Callable[[ErrorStats], str]) -> Cell:
        return lambda r: (fmt(r.errors) if r.errors else "", "")

    columns = [
        column("tensor", lambda r: (safe(r.name), ""), fold=12 if fold_names else 0, names=True),
        column("shape", lambda r: (_shape(r.shape), ""), hide=1),
        column(headers[0], lambda r: (_dtype_cell(r), "")),
        column(headers[1], lambda r: (safe(r.detail), "dim" if r.dimmed else ""), fold=16),
    ]
    if any(r.errors for r in rows):  # a plan without --estimate: no figures to show
        columns += [
            column("MSE", figure(lambda e: f"{e.mse:.3g}"), right=True, hide=3),
            column("max err", figure(lambda e: f"{e.max_abs:.3g}"), right=True, hide=2),
            column("SQNR dB", figure(lambda e: _fmt_sqnr(e.sqnr_db)), right=True),
        ]
        if any(getattr(r, "weighted", None) is not None for r in rows):  # quantize --imatrix
            columns.append(column("wSQNR", _weighted_cell, right=True))
        if any(r.errors is not None and r.errors.mse_gain is not None for r in rows):
            columns.append(column("vs minmax", lambda r: (_fmt_gain(r.errors), ""), right=True,
                                  hide=5))  # fmt: skip
        columns.append(column("", figure(lambda e: _spark(e.sqnr_db)), hide=4, label="SQNR bar"))
    if failed is not None:
        columns.append(column("gate", lambda r: _gate_cell(r, failed)))
    return columns


def _weighted_cell(r: Row) -> tuple[str, str]:
    """The activation-weighted SQNR (docs/numerics.md), blank for a tensor without one."""
    weighted: WeightedError | None = getattr(r, "weighted", None)
    if weighted is None:
        return ("", "")
    value = weighted.sqnr_db
    return ("n/a" if math.isnan(value) else _fmt_sqnr(value), "")


def _fmt_gain(stats: ErrorStats | None) -> str:
    """The squared error against min-max's, as a percentage: '-8.2 %'."""
    gain = stats.mse_gain if stats is not None else None
    return "" if gain is None else f"{gain * 100:+.1f} %"


def _dtype_cell(r: Row) -> str:
    """'F32→I8'; 4-bit codes, stored two to a U8 byte, as what they are: 'F32→I4' (int4),
    'F32→U4' (uint4)."""
    a, b = r.dtypes
    spec = getattr(r, "spec", None)
    if isinstance(spec, Codec):
        b = spec.codes_label(b)
    return f"{a}→{b}" if a != b else a


def _gate_cell(r: Row, failed: set[str]) -> tuple[str, str]:
    if r.name in failed:
        return ("FAIL", "bold red")
    return ("ok" if r.errors else "", "")


def _report(
    title: str | list[str], columns: list[Column], summary: list[str], stream: IO[str]
) -> tuple[list[Line], int, list[str]]:
    """The title (its parts joined by "; "), the table and the summary phrases laid out for
    `stream`, with the width and the hidden columns (for the note)."""
    width = width_of(stream)
    table = layout.table(columns, width)
    titles = [title] if isinstance(title, str) else title
    lines = _plain(layout.phrases(titles, width, "; ")) + table.lines
    lines += _plain(layout.phrases(summary, width))
    return lines, width, table.hidden


def print_quantize(
    summary: QuantizeSummary, rows: list[QuantizeRow] | None = None, gate: GateResult | None = None
) -> None:
    title = ["Plan (dry run, nothing written)" if summary.dry_run else "Quantization report"]
    if summary.overall is not None:
        title.append(f"errors {summary.measured}")
    # a model-level bound alone (--max-kl-ratio) has no per-tensor verdict to show
    failed = gate.failed_tensors() if gate is not None and gate.gate.per_tensor else None
    shown = summary.rows if rows is None else rows
    columns = quantize_columns(shown, failed, fold_names=sys.stdout.isatty())
    lines, width, hidden = _report(title, columns, _quantize_totals(summary), sys.stdout)
    more = len(shown) < len(summary.rows)
    _notes(lines, width, _hidden_line(hidden, sys.stdout) if hidden else None,
           _shown_line(len(shown), len(summary.rows)) if more else None,
           *(safe(r) for r in summary.remarks))  # fmt: skip
    verb = "would write " if summary.dry_run else "wrote "
    lines += _plain(
        layout.phrases(
            [verb + safe(p) for p in summary.outputs[:1]] + [safe(p) for p in summary.outputs[1:]],
            width,
            ", ",
        )
    )
    lines += _gate_lines(gate, width, summary.model_kl)
    emit(sys.stdout, lines)
    for name in summary.skipped[:1]:
        print_warning(f"skipped {len(summary.skipped)} non-tensor entries (e.g. {name!r})")


def _quantize_totals(summary: QuantizeSummary) -> list[str]:
    n, q = len(summary.rows), len(summary.quantized)
    ratio = summary.bytes_in / summary.bytes_out if summary.bytes_out else 0.0
    parts = [
        f"{q} of {n} tensors quantized{_written_specs(summary)}, {n - q} kept",
        f"{_fmt_bytes(summary.bytes_in)} → {_fmt_bytes(summary.bytes_out)} ({ratio:.2f}x)",
    ]
    overall = summary.overall
    if overall is not None:
        parts.append(f"overall SQNR {_fmt_db(overall.sqnr_db)} ({_pooled(summary.pooled_over)})")
    if overall is not None and overall.mse_gain is not None:
        parts.append(f"mse range search: {_fmt_gain(overall)} squared error vs minmax")
    weighted = summary.weighted_overall
    if weighted is not None:
        parts.append(f"weighted SQNR {_fmt_db(weighted.sqnr_db)} (wSQNR: by the imatrix)")
    if summary.model_kl:
        parts.append(_model_kl(summary))
    if summary.budget_sizes is not None:
        int8, flt = summary.budget_sizes
        eight = f"all-{summary.budget_reference}"
        parts.append(
            f"budget: {_fmt_bytes(summary.bytes_out)} vs {eight} {_fmt_bytes(int8)}, "
            f"all-float {_fmt_bytes(flt)}"
        )
    return parts


def _model_kl(summary: QuantizeSummary) -> str:
    """'model KL (nats/token): held-out windows of a.txt, 2040 positions: 0.1523 (rounding
    0.4311); check text b.txt, 510 positions: 0.2410 (rounding 0.4690)'."""
    texts = {t.role: t.name for t in reversed(summary.texts)}  # the first of each role
    named = {"held-out": texts.get(Role.CALIBRATION), "check text": texts.get(Role.CHECK)}
    figures = "; ".join(
        f"{_kl_stream(k.stream, named.get(k.stream))}, {k.tokens} positions: "
        f"{_fmt_kl(k.chosen)} (rounding {_fmt_kl(k.rounding)})"
        for k in summary.model_kl
    )
    return f"model KL (nats/token): {figures}"


def _kl_stream(stream: str, text: str | None) -> str:
    where = kl_where(stream)
    if text is None:
        return where
    return f"{where} of {safe(text)}" if stream == "held-out" else f"{where} {safe(text)}"


def _fmt_kl(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


_SPECS_SHOWN = 3


def _written_specs(summary: QuantizeSummary) -> str:
    """' (sym int8 axis 0)', or what each spec was written for: ' (180 sym int4 axis 0, 30 sym
    int4 group 128)'; the first few, then how many more; '' when nothing was quantized."""
    by_spec = summary.by_spec
    if len(by_spec) == 1:
        return f" ({by_spec[0][0]})"
    # one more is named: '1 more specs' took the place its own count and name would take
    first = by_spec if len(by_spec) <= _SPECS_SHOWN + 1 else by_spec[:_SPECS_SHOWN]
    shown = [f"{n} {label}" for label, n, _ in first]
    if len(by_spec) > len(first):
        shown.append(f"{len(by_spec) - len(first)} more specs")
    return f" ({', '.join(shown)})" if shown else ""


def _pooled(pooled_over: str) -> str:
    """What an overall SQNR pools, for the summary line."""
    return "quantized tensors" if pooled_over == "quantized" else "all compared tensors"


# ---- compare -----------------------------------------------------------------------------------


def print_compare(summary: CompareSummary, rows: list[CompareRow], gate: GateResult | None) -> None:
    failed = gate.failed_tensors() if gate is not None and gate.gate.active else None
    title = [f"{safe(summary.inputs[0])} (A) vs {safe(summary.inputs[1])} (B)"]
    if summary.overall is not None:
        title.append(f"errors {summary.measured}")
    columns = quantize_columns(rows, failed, ("dtype A→B", "compared"), sys.stdout.isatty())
    overall = summary.overall
    totals = [
        f"{len(summary.compared)} of {len(summary.rows)} tensors compared, "
        f"{len(summary.mismatches)} mismatched"
    ]
    if overall is not None:
        totals.append(f"overall SQNR {_fmt_db(overall.sqnr_db)} ({_pooled(summary.pooled_over)})")
    lines, width, hidden = _report(title, columns, totals, sys.stdout)
    more = len(rows) < len(summary.rows)
    _notes(lines, width, _hidden_line(hidden, sys.stdout) if hidden else None,
           _shown_line(len(rows), len(summary.rows)) if more else None)  # fmt: skip
    lines += _gate_lines(gate, width)
    emit(sys.stdout, lines)


# ---- dequantize --------------------------------------------------------------------------------


def _dtype_word(st_dtype: str) -> str:
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(st_dtype, st_dtype)


def print_dequantize(summary: DequantizeSummary) -> None:
    restored = sum(r.restored for r in summary.rows)
    cast = [r for r in summary.rows if r.cast]
    total = sum(r.bytes_out for r in summary.rows)
    copied = len(summary.rows) - restored - len(cast)
    others = [f"{len(cast)} cast to {_dtype_word(cast[0].dtype)}"] if cast else []
    others += [f"{copied} copied byte for byte"] if copied or not cast else []
    done = (
        f"dequantized {restored} of {len(summary.rows)} tensors ({', '.join(others)}), "
        f"{_fmt_bytes(total)};"
    )
    paths = [safe(p) for p in summary.outputs]
    parts = [f"{done} wrote {paths[0]}" if paths else done, *paths[1:]]
    emit(sys.stdout, _plain(layout.phrases(parts, width_of(sys.stdout), ", ")))


# ---- plot --------------------------------------------------------------------------------------


def _bits(nbytes: int, numel: int) -> str:
    return f"{8 * nbytes / numel:.2f}" if numel else "-"


def print_inspect(summary: InspectSummary) -> None:
    quantized = any(r.qinfo for r in summary.rows)
    shards = f"{summary.shards} shard{'s' if summary.shards != 1 else ''}"
    kind = f"{summary.kind}, {shards}" if summary.shards else summary.kind
    title = f"{safe(summary.path)} ({kind})"
    rows = summary.rows
    columns = [
        Column(
            "tensor",
            [(safe(r.name), "") for r in rows],
            fold=12 if sys.stdout.isatty() else 0,
            names=True,
        ),
        Column("dtype", [(r.dtype, "") for r in rows]),
        Column("shape", [(_shape(r.shape), "") for r in rows]),  # whole, as names are
        Column("elements", [(f"{r.numel:,}", "") for r in rows], right=True, hide=1),
        Column("bytes", [(_fmt_bytes(r.nbytes), "") for r in rows], right=True, hide=2),
    ]
    if quantized:
        columns.append(Column("quantization", [(_qinfo_text(r.qinfo), "") for r in rows],
                              fold=16))  # fmt: skip
    if summary.type_totals is not None:  # GGUF: bits per weight of each tensor and each type
        columns.append(Column("bits/w", [(_bits(r.nbytes, r.numel), "") for r in rows], right=True))
    totals = [
        f"{_count(len(rows), 'tensor')}, {summary.total_numel:,} elements, "
        f"{_fmt_bytes(summary.total_bytes)}"
    ]
    lines, width, hidden = _report(title, columns, totals, sys.stdout)
    for t in summary.type_totals or []:
        text = (f"  {t.dtype}: {_count(t.tensors, 'tensor')}, {t.numel:,} elements, "
                f"{_fmt_bytes(t.nbytes)}, {t.bits_per_weight:.2f} bits/w")  # fmt: skip
        lines += _plain(layout.phrases([text], width))
    _notes(lines, width, _hidden_line(hidden, sys.stdout) if hidden else None)
    if summary.metadata:
        text = "metadata: " + safe(json.dumps(summary.metadata, ensure_ascii=False))
        lines += _plain(layout.phrases([text], width))
    if summary.manifest:
        lines += _plain(layout.phrases(_manifest_parts(summary.manifest), width, ", "))
    if summary.quantized_modules is not None:
        ignore = ", ".join(summary.ignore or []) or "none"
        text = f"{summary.quantized_modules} quantized modules; ignore (kept float): {ignore}"
        lines += _plain(layout.phrases([text], width))
    emit(sys.stdout, lines)
    for note in summary.notes:
        print_warning(note)


def _count(n: int, noun: str) -> str:
    """'1 tensor', '2 tensors'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


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


def _manifest_parts(manifest: dict[str, object]) -> list[str]:
    tensors = manifest.get("tensors", {})
    count = len(tensors) if isinstance(tensors, dict) else 0
    return [
        f"manifest: {manifest.get('format')} v{manifest.get('format_version')}",
        f"semantics {manifest.get('semantics')!r}",
        f"qtool {manifest.get('qtool_version')}",
        f"for {safe(str(manifest.get('quantized_file')))}",
        _count(count, "quantized tensor"),
    ]


# ---- progress ----------------------------------------------------------------------------------


PROGRESS_COLUMNS = 64  # what the bar, percentage, bytes, speed and time left take
NARROW_BAR = 10  # the bar's width below 100 columns (20 above): the tensor's name needs it more


class _BarProgress:
    """Bytes done of the whole run, the tensor being processed, throughput and time left, on
    stderr. The loop names each tensor as it starts and adds its bytes as they are done (slab by
    slab for a large one), so the bar moves within a large tensor."""

    def __init__(self, progress: Progress, width: int) -> None:
        self._progress = progress
        self._task = progress.add_task("", total=None, visible=False)  # shown once sized
        narrowed = 20 - NARROW_BAR if width < 100 else 0
        self._name_width = max(16, width - PROGRESS_COLUMNS + narrowed)

    def start(self, total_bytes: int) -> None:
        self._progress.update(self._task, total=total_bytes, visible=True)

    def advance(self, name: str, nbytes: int) -> None:
        shown = _middle_cut(safe(name), self._name_width)
        self._progress.update(self._task, advance=nbytes, description=shown)


def _middle_cut(name: str, width: int) -> str:
    """`name` in at most `width` characters: whole when it fits, else from its layer number on
    (`…11.self_attn.q_proj.weight`: the prefix before it is the same in every row), without a
    final `.weight`/`.bias` if need be, then less the parts after the number, first ones first
    (`…11.q_proj`); a name without a number, or still too long, keeps its start and its end
    around an ellipsis."""
    if len(name) <= width:
        return name
    parts = name.split(".")
    number = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if number is not None and number + 1 < len(parts):
        rest = parts[number:]
        if rest[-1] in ("weight", "bias") and len(rest) > 2:
            rest = rest[:-1]
        tails = ([rest[0], *rest[-k:]] for k in range(len(rest) - 2, 0, -1))
        for shown in (parts[number:], rest, *tails):
            if 1 + len(".".join(shown)) <= width:
                return "…" + ".".join(shown)
        name = "…" + ".".join([rest[0], rest[-1]])
    tail = (width - 1) * 2 // 3
    return name[: width - 1 - tail] + "…" + name[len(name) - tail :]


class _SteadyTimeLeft(ProgressColumn):
    """Time left from the average speed since the start (Rich's own column follows the last
    few updates, which jump between small and large tensors): steady, and right on average.
    The estimate is made when the count moves and counts down in real time until it moves
    again: re-estimated at every refresh, it grew while a long step ran (eval's 512-token
    windows), the time spent in the step counting against the work done before it."""

    def __init__(self) -> None:
        super().__init__()
        self._estimates: dict[TaskID, tuple[float, float, float]] = {}  # done, at, seconds left

    def render(self, task: Task) -> Text:
        elapsed, done, total = task.elapsed, task.completed, task.total
        if not elapsed or not done or not total or elapsed < 1.0:
            return Text("-:--:--", style="progress.remaining")
        seen = self._estimates.get(task.id)
        if seen is None or seen[0] != done:
            seen = (done, elapsed, elapsed * max(0.0, total - done) / done)
            self._estimates[task.id] = seen
        left = int(max(0.0, seen[2] - (elapsed - seen[1])))
        return Text(f"{left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}",
                    style="progress.remaining")  # fmt: skip


@contextmanager
def progress_bar() -> Iterator[_BarProgress | None]:
    """A transient bar while stderr is an interactive terminal; None (nothing at all) otherwise."""
    err = console(sys.stderr)
    if not err.is_interactive:
        yield None
        return
    columns = (
        TextColumn("{task.description}", style="dim"),
        BarColumn(bar_width=20 if err.width >= 100 else NARROW_BAR),
        TaskProgressColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        _SteadyTimeLeft(),
    )
    with Progress(*columns, console=err, transient=True) as progress:
        yield _BarProgress(progress, err.width)
