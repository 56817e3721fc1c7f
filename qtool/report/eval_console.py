"""`qtool eval` for people: the figures of both models, the per-layer table, the gate line,
and a progress bar (tokens, tokens/s) on stderr in a terminal. Renders with Rich, through
report/console.py's streams (no colour off a terminal, control characters escaped)."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
from rich.progress import Task as RichTask
from rich.table import Table
from rich.text import Text

from qtool.eval_results import EvalSummary, EvalViolation, LayerRow
from qtool.report.console import console, emit, safe


def print_eval(
    summary: EvalSummary,
    layers: list[LayerRow] | None,
    violations: list[EvalViolation] | None,
    order: str,
) -> None:
    """The report on stdout; `violations` None: no bound was given."""
    lines: list[Any] = [*_header(summary), _figures(summary)]
    if layers is not None:
        lines += _layer_lines(summary, layers, order)
    lines.append(Text(_speed(summary)))
    if violations is not None:
        lines.append(_gate_line(violations))
    emit(sys.stdout, *lines)


def _header(s: EvalSummary) -> list[Text]:
    pieces = "windows" if s.causal is not None else "sentences"
    scored = f", {s.causal.predicted:,} positions scored" if s.causal is not None else ""
    cut = f"of {s.ctx}" if s.causal is not None else f"cut at {s.ctx}"
    return [
        Text(f"FLOAT {safe(s.inputs[0])} ({safe(s.architecture)})"),
        Text(f"QUANT {safe(s.inputs[1])} ({safe(s.loaded_as)})"),
        Text(
            f"{s.tokens:,} tokens of {safe(s.text.source)} in {s.windows:,} {pieces} {cut}"
            f"{scored}; {s.dtype} on {s.device}"
        ),
    ]


def _figures(s: EvalSummary) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("figure", no_wrap=True)
    table.add_column("value", no_wrap=True)
    c, e = s.causal, s.encoder
    if c is not None:
        table.add_row("perplexity FLOAT", f"{c.ppl_float:,.2f}")
        table.add_row("perplexity QUANT", f"{c.ppl_quant:,.2f} (x{c.ppl_ratio:.4f})")
        table.add_row("KL(FLOAT ‖ QUANT) mean", f"{_num(c.kl.mean)} nats per token")
        kl = c.kl
        table.add_row("KL median, p90, p99, max", ", ".join(map(_num, (kl.median, kl.p90,
                      kl.p99, kl.max))))  # fmt: skip
        table.add_row("top-1 agreement", f"{c.top1 * 100:.1f} % ({c.agree:,} of {c.predicted:,})")
    if e is not None:
        table.add_row("cosine mean", f"{e.cosine_mean:.6f} ({e.sentences:,} sentences)")
        table.add_row("cosine min", f"{e.cosine_min:.6f}")
        table.add_row("last hidden state rel. error", _num(e.hidden_rel_error))
    table.add_row("weights that differ", f"{s.changed:,} of {s.parameters:,} tensors")
    return table


def _num(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def _layer_lines(s: EvalSummary, layers: list[LayerRow], order: str) -> list[Any]:
    total = len(s.layers or ())
    first = {"output": "worst output SQNR first", "weight": "worst weight SQNR first"}
    title = f"Per quantized Linear ({first.get(order, 'model order')}; output on FLOAT's inputs)"
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("layer", overflow="fold", min_width=12)
    table.add_column("shape", no_wrap=True)
    for header in ("weight SQNR dB", "output SQNR dB", "output - weight"):
        table.add_column(header, justify="right", no_wrap=True)
    for r in layers:
        gap = _db(r.output_sqnr_db - r.weight_sqnr_db, signed=True)
        shape = "[" + ", ".join(map(str, r.shape)) + "]"
        table.add_row(Text(safe(r.name)), shape, _db(r.weight_sqnr_db), _db(r.output_sqnr_db), gap)
    out: list[Any] = [Text(title), table]
    if not layers:
        out = [Text("no Linear's weight differs between FLOAT and QUANT")]
    elif len(layers) < total:
        out.append(Text(f"(showing {len(layers)} of {total} layers)", style="dim"))
    return out


def _db(value: float, signed: bool = False) -> str:
    if value == math.inf:
        return "exact"
    if not math.isfinite(value):
        return str(value)
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def _speed(s: EvalSummary) -> str:
    return (
        f"2 models x {s.tokens:,} tokens in {s.eval_seconds:.2f} s "
        f"({s.tokens_per_second:,.0f} tokens/s); loading took {s.load_seconds:.1f} s"
    )


def _gate_line(violations: list[EvalViolation]) -> Text:
    if not violations:
        return Text("gate: passed", style="green")
    broken = "; ".join(safe(v.detail) for v in violations)
    return Text(f"gate: FAILED ({broken})", style="bold red")


# ---- progress ------------------------------------------------------------------------------


class _TokensPerSecond(ProgressColumn):
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
               _TokensPerSecond())  # fmt: skip
    with Progress(*columns, console=err, transient=True) as progress:
        yield _EvalProgress(progress)
