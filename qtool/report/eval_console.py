"""`qtool eval` for people: the figures of both models, the per-layer table, the gate line,
and a progress bar (tokens, tokens/s) on stderr in a terminal. Laid out as plain lines within
the output's width (report/layout.py) and printed through report/console.py (styles on a
terminal only, control characters escaped); Rich draws the progress bar alone."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
from rich.progress import Task as RichTask
from rich.text import Text

from qtool.eval_results import CausalFigures, EvalSummary, EvalViolation, FloatPass, LayerRow
from qtool.report import layout
from qtool.report.console import _SteadyTimeLeft as SteadyTimeLeft  # quantize's time left
from qtool.report.console import console, emit, safe, width_of
from qtool.report.eval_json import FloatSide
from qtool.report.layout import Column, Line


def print_eval(
    summary: EvalSummary,
    layers: list[LayerRow] | None,
    violations: list[EvalViolation] | None,
    order: str,
    side: FloatSide | None = None,
) -> None:
    """The report on stdout; `violations` None: no bound was given; `side`: the logits file
    FLOAT's side was read from or written to."""
    width = width_of(sys.stdout)
    lines = _plain([piece for line in _header(summary) for piece in layout.phrases([line], width)])
    lines += layout.table(_figures(summary), width).lines
    if layers is not None:
        lines += _layer_lines(summary, layers, order, width)
    lines += _plain(layout.phrases([_speed(summary, side)], width))
    lines += _side_lines(side, width)
    if violations is not None:
        lines += _gate_lines(violations, width)
    emit(sys.stdout, lines)


def _plain(texts: list[str], style: str = "") -> list[Line]:
    return [[(t, style)] for t in texts]


def _header(s: EvalSummary) -> list[str]:
    pieces = "window" if s.causal is not None else "sentence"
    pieces += "" if s.windows == 1 else "s"
    scored = f", {s.causal.predicted:,} positions scored" if s.causal is not None else ""
    cut = f"of {s.ctx}" if s.causal is not None else f"cut at {s.ctx}"
    return [
        f"FLOAT {safe(s.inputs[0])} ({safe(s.architecture)})",
        f"QUANT {safe(s.inputs[1])} ({safe(s.loaded_as)})",
        f"{s.tokens:,} tokens of {safe(s.text.source)} in {s.windows:,} {pieces} {cut}{scored}; "
        f"{s.dtype} on {s.device}",
    ]


def _figures(s: EvalSummary) -> list[Column]:
    rows: list[tuple[str, str]] = []
    c, e = s.causal, s.encoder
    if c is not None:
        kl = c.kl
        rows += [
            ("perplexity FLOAT", f"{c.ppl_float:,.2f}"),
            ("perplexity QUANT", f"{c.ppl_quant:,.2f} (x{c.ppl_ratio:.4f})"),
            ("KL(FLOAT ‖ QUANT) mean", f"{_num(kl.mean)} nats per token"),
            ("KL median, p90, p99, p99.9, max",
             ", ".join(map(_num, (kl.median, kl.p90, kl.p99, kl.p999, kl.max)))),
            ("top-1 agreement", f"{c.top1 * 100:.1f} % ({c.agree:,} of {c.predicted:,})"),
            ("ln(PPL ratio) ± se", f"{_signed(c.ln_ratio)} ± {_num(c.ln_ratio_se)}"),
            ("mean Δp of next token", f"{_signed(c.dp_mean * 100, 3)} percentage points"),
        ]  # fmt: skip
    if e is not None:
        rows += [
            ("cosine mean", f"{e.cosine_mean:.6f} ({e.sentences:,} sentences)"),
            ("cosine min", f"{e.cosine_min:.6f}"),
            ("last hidden state rel. error", _num(e.hidden_rel_error)),
        ]
    rows.append(("weights that differ", f"{s.changed:,} of {s.parameters:,} tensors"))
    return [
        Column("figure", [(name, "") for name, _ in rows], fold=12),
        Column("value", [(value, "") for _, value in rows], fold=16),
    ]


def _signed(value: float, digits: int = 5) -> str:
    return f"{value:+.{digits}f}" if math.isfinite(value) else str(value)


def _num(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def _layer_lines(s: EvalSummary, layers: list[LayerRow], order: str, width: int) -> list[Line]:
    if not layers:
        return _plain(["no Linear's weight differs between FLOAT and QUANT"])
    total = len(s.layers or ())
    first = {"output": "worst output SQNR first", "weight": "worst weight SQNR first"}
    title = f"Per quantized Linear ({first.get(order, 'model order')}; output on FLOAT's inputs)"
    columns = [
        Column(
            "layer",
            [(safe(r.name), "") for r in layers],
            fold=12 if sys.stdout.isatty() else 0,
            names=True,
        ),
        Column("shape", [("[" + ", ".join(map(str, r.shape)) + "]", "") for r in layers], hide=1),
        Column("weight SQNR dB", [(_db(r.weight_sqnr_db), "") for r in layers], right=True),
        Column("output SQNR dB", [(_db(r.output_sqnr_db), "") for r in layers], right=True),
        Column(
            "output - weight",
            [(_db(r.output_sqnr_db - r.weight_sqnr_db, signed=True), "") for r in layers],
            right=True,
            hide=2,
        ),
    ]
    table = layout.table(columns, width)
    out = _plain(layout.phrases([title], width)) + table.lines + _hidden_note(table, width)
    if len(layers) < total:
        out += _plain([f"(showing {len(layers)} of {total} layers)"], "dim")
    return out


def _hidden_note(table: layout.Table, width: int) -> list[Line]:
    """Which columns a table hid to fit the width, and how to see them."""
    if not table.hidden:
        return []
    how = "widen the terminal" if sys.stdout.isatty() else "set COLUMNS wider"
    return _plain(layout.phrases(
        [f"({', '.join(table.hidden)} hidden to fit {width} columns; {how}, or use --json)"],
        width,
    ), "dim")  # fmt: skip


def _db(value: float, signed: bool = False) -> str:
    if value == math.inf:
        return "exact"
    if not math.isfinite(value):
        return str(value)
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def _speed(s: EvalSummary, side: FloatSide | None) -> str:
    if side is None:  # a pair run: both models over the windows, timed together
        return (
            f"2 models x {s.tokens:,} tokens in {s.eval_seconds:.2f} s "
            f"({s.tokens_per_second:,.0f} tokens/s); loading took {s.load_seconds:.1f} s"
        )
    return f"QUANT x {s.tokens:,} tokens in {s.eval_seconds:.2f} s {_after(side)}; " \
        f"loading took {s.load_seconds:.1f} s"  # fmt: skip


def _after(side: FloatSide) -> str:
    """What the float side came from: a float pass (untimed here), or a file and no pass."""
    if side.read:
        return f"against FLOAT's side read from {safe(str(side.path))} (no float pass)"
    return "after one float pass"


def _side_lines(side: FloatSide | None, width: int) -> list[Line]:
    if side is None:
        return []
    if not side.read:
        return _plain(layout.phrases([f"wrote {safe(str(side.path))}"], width))
    note = ("(KL from FLOAT's log-probabilities as the file codes them in 16 bits: each within "
            "1.8e-4 nats, see docs/eval.md; the other figures are exact)")  # fmt: skip
    return _plain(layout.phrases([note], width), "dim")


def _gate_lines(violations: list[EvalViolation], width: int) -> list[Line]:
    if not violations:
        return _plain(["gate: passed"], "green")
    broken = "; ".join(safe(v.detail) for v in violations)
    return _plain(layout.phrases([f"gate: FAILED ({broken})"], width), "bold red")


def print_many(
    results: list[tuple[EvalSummary, list[EvalViolation]]],
    gated: bool,
    side: FloatSide | None,
    measured: FloatPass | None = None,
) -> None:
    """Several QUANTs against one float pass: the shared header, a row per QUANT, the gate;
    FLOAT's side alone (`measured`) when there is no QUANT."""
    width = width_of(sys.stdout)
    lines: list[Line] = []
    if not results and measured is not None:
        lines += _plain([p for line in _float_lines(measured, side)
                         for p in layout.phrases([line], width)])  # fmt: skip
    if results:
        first = results[0][0]
        header = _header(first)
        header = [header[0], header[2], f"perplexity FLOAT {first.causal.ppl_float:,.2f}; "
                  "KL(FLOAT ‖ QUANT) mean, median, p99, p99.9, max in nats per token"
                  if first.causal is not None else ""]  # fmt: skip
        lines += _plain([p for line in header if line for p in layout.phrases([line], width)])
        names = short_paths([s.inputs[1] for s, _ in results])
        table = layout.table(_many_columns([s for s, _ in results], names), width)
        lines += table.lines + _hidden_note(table, width)
        if names != [s.inputs[1] for s, _ in results]:
            lines += _plain(layout.phrases(["(QUANT: each path's shortest distinct ending; the "
                                            "gate lines and --json give them whole)"], width),
                            "dim")  # fmt: skip
        seconds = sum(s.eval_seconds for s, _ in results)
        loading = sum(s.load_seconds for s, _ in results)
        after = _after(side) if side is not None else "after one float pass"
        speed = (f"{len(results)} QUANTs x {first.tokens:,} tokens in {seconds:.2f} s {after}; "
                 f"loading took {loading:.1f} s")  # fmt: skip
        lines += _plain(layout.phrases([speed], width))
    lines += _side_lines(side, width)
    if gated:
        failed = [(s, v) for s, v in results if v]
        if not failed:
            lines += _plain(["gate: passed"], "green")
        for s, v in failed:
            broken = "; ".join(safe(x.detail) for x in v)
            lines += _plain(layout.phrases([f"gate: FAILED {safe(s.inputs[1])} ({broken})"],
                                           width), "bold red")  # fmt: skip
    emit(sys.stdout, lines)


def _float_lines(m: FloatPass, side: FloatSide | None) -> list[str]:
    pieces = "window" if m.windows == 1 else "windows"
    done = (f"read from {safe(str(side.path))} (no float pass)" if side is not None and side.read
            else f"one float pass, loading included, in {m.seconds:.1f} s")  # fmt: skip
    return [
        f"FLOAT {safe(m.float_dir)}",
        f"{m.tokens:,} tokens of {safe(m.text.source)} in {m.windows:,} {pieces} of {m.ctx}, "
        f"{m.positions:,} positions scored; {m.dtype} on {m.device}",
        f"perplexity FLOAT {m.ppl_float:,.2f}; {done}",
    ]


def short_paths(paths: list[str]) -> list[str]:
    """Each path's last components, as few as keep them distinct (`a/q4/model.gguf` and
    `b/q4/model.gguf` stay whole): the QUANT column shows what tells the candidates apart."""
    parts = [p.rstrip("/").split("/") for p in paths]
    longest = max((len(p) for p in parts), default=0)
    for k in range(1, longest + 1):
        ends = ["/".join(p[-k:]) for p in parts]
        if len(set(ends)) == len(ends):
            whole = zip(ends, parts, paths, strict=True)
            return [end if len(p) > k else path for end, p, path in whole]
    return paths


def _many_columns(summaries: list[EvalSummary], names: list[str]) -> list[Column]:
    def col(title: str, cell: Callable[[CausalFigures], str], hide: int = 0) -> Column:
        cells = [(cell(s.causal) if s.causal else "", "") for s in summaries]
        return Column(title, cells, right=True, hide=hide)

    return [
        Column("QUANT", [(safe(n), "") for n in names], fold=12, names=True),
        col("perplexity", lambda c: f"{c.ppl_quant:,.2f}"),
        col("ln ratio ± se", lambda c: f"{_signed(c.ln_ratio, 4)} ± {c.ln_ratio_se:.4f}", 1),
        col("KL mean", lambda c: _num(c.kl.mean)),
        col("median", lambda c: _num(c.kl.median), 3),
        col("p99", lambda c: _num(c.kl.p99), 2),
        col("p99.9", lambda c: _num(c.kl.p999), 3),
        col("max", lambda c: _num(c.kl.max), 3),
        col("top-1", lambda c: f"{c.top1 * 100:.1f} %"),
        col("Δp (pp)", lambda c: _signed(c.dp_mean * 100, 2), 2),  # percentage points
    ]


# ---- progress ------------------------------------------------------------------------------


class TokensPerSecond(ProgressColumn):
    """The rate of a progress whose units are tokens (eval, calibrate)."""

    def render(self, task: RichTask) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} tokens/s" if speed else "", style="dim")


class _EvalProgress:
    """Loading (no total yet), then tokens through both models and the rate."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._task = progress.add_task("loading FLOAT and QUANT", total=None)

    def start(self, total_bytes: int) -> None:
        self._progress.update(self._task, total=total_bytes, description="tokens")

    def advance(self, name: str, nbytes: int) -> None:
        self._progress.update(self._task, advance=nbytes)


@contextmanager
def eval_progress() -> Iterator[_EvalProgress | None]:
    """A transient bar while stderr is an interactive terminal; None (nothing) otherwise."""
    err = console(sys.stderr)
    if not err.is_interactive:
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TokensPerSecond(), SteadyTimeLeft())  # fmt: skip
    with Progress(*columns, console=err, transient=True) as progress:
        yield _EvalProgress(progress)
