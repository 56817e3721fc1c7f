"""`qtool calibrate`'s report on stdout and its progress on stderr (a bar per block with
tokens/s while stderr is a terminal, nothing otherwise, as `qtool eval` does)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
from rich.progress import Task as RichTask
from rich.text import Text

from qtool.calibrate_results import (
    CalibrateSummary,
    DatasetInfo,
    JointSummary,
    MergeSummary,
    SensitivitySummary,
)
from qtool.report import layout
from qtool.report.console import _SteadyTimeLeft as SteadyTimeLeft  # quantize's time left
from qtool.report.console import console, emit, safe, width_of
from qtool.report.layout import Line

MIB = 1 << 20


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 token', '2 tokens', '1,024 tokens'."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def print_calibrate(s: CalibrateSummary) -> None:
    texts = [
        f"{counted(s.tokens, 'token')} in {counted(s.windows, 'window')} of {s.ctx}",
        *[_dataset(d) for d in s.datasets],
    ]
    block, held = s.peak_block_bytes / MIB, s.activation_bytes / MIB
    _emit([
        f"{safe(s.model)} ({safe(s.architecture)}): {counted(s.blocks, 'block')}, one at a "
        f"time, on {s.device}",
        *texts,
        f"wrote {safe(s.output)}: {s.entries} {_weights(s.entries)} importance (llama.cpp's "
        "names)",
        f"{counted(s.tokens, 'token')} in {s.run_seconds:.2f} s "
        f"({s.tokens_per_second:,.0f} tokens/s); "
        f"loading took {s.load_seconds:.1f} s; held at once: one block's weights "
        f"({block:.1f} MiB) and the activations ({held:.1f} MiB)",
        *_sensitivity(s.sensitivity),
    ])  # fmt: skip


def _sensitivity(s: SensitivitySummary | None) -> list[str]:
    """What was measured and how, the Linears with the largest alpha, then the joint fit."""
    if s is None:
        return []
    top = sorted(s.linears, key=lambda x: -x.alpha)[:3]
    passes = "pass" if s.passes == 1 else "passes"
    return [
        f"sensitivity of {counted(len(s.linears), 'tensor')} ({safe(s.reference)}) on "
        f"{counted(s.tokens, 'token')}: {s.passes} {passes} over the blocks, "
        f"{counted(s.block_loads, 'block load')}, {s.seconds:.1f} s",
        "most sensitive (KL per unit of output error): "
        + ", ".join(f"{safe(x.name)} {x.alpha:.3g}" for x in top),
        *_joint(s.joint),
    ]


def _joint(j: JointSummary | None) -> list[str]:
    if j is None:
        return []
    measured = (f"joint KL of every tensor at once on {counted(j.tokens, 'token')}: "
                f"{j.kl:.4g} at the reference, {j.kl_half:.4g} at half of it")  # fmt: skip
    if j.fit is None:
        return [f"{measured}; no curve fits them (the half's KL is not below), so the file "
                "holds no joint fit: predicted KL = sum alpha r"]  # fmt: skip
    gain, saturation, additivity = j.fit
    return [f"{measured}; predicted KL = {gain:.4g} S / (1 + {saturation:.4g} S), S = sum "
            f"alpha r; additivity {additivity:.3g} (joint / summed single KLs, sensitivity "
            "windows)"]  # fmt: skip


def print_merge(s: MergeSummary) -> None:
    _emit([
        f"merged {len(s.inputs)} importance matrices: {counted(s.entries, 'weight')}, "
        f"{counted(s.chunk_count, 'chunk')} of {s.chunk_size}",
        *[_dataset(d) for d in s.datasets],
        f"wrote {safe(s.output)}",
    ])  # fmt: skip


def _dataset(d: DatasetInfo) -> str:
    if d.sha256 is None or d.tokens is None:
        return f"  {safe(d.name)}"
    return f"  {safe(d.name)}: {counted(d.tokens, 'token')}, sha256 {d.sha256[:16]}"


def _weights(n: int) -> str:
    return "weight's" if n == 1 else "weights'"


def _emit(texts: list[str]) -> None:
    width = width_of(sys.stdout)
    lines: list[Line] = [[(t, "")] for text in texts for t in layout.phrases([text], width)]
    emit(sys.stdout, lines)


class AverageTokensPerSecond(ProgressColumn):
    """Tokens through the whole model over the phase's time so far: the summary line's tokens/s
    (tokens / run seconds), where rich's speed is that of the last samples only."""

    def render(self, task: RichTask) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        rate = task.completed / elapsed if elapsed else 0.0
        return Text(f"{rate:,.0f} tokens/s" if rate else "", style="dim")


class _CalibrateProgress:
    """Loading (no total yet), then tokens through each block, the block named."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._task = progress.add_task("loading the model and the text", total=None)

    def start(self, total_bytes: int) -> None:  # a phase's clock starts here, not at loading
        self._progress.reset(self._task, total=total_bytes, description="tokens")

    def advance(self, name: str, nbytes: int) -> None:
        self._progress.update(self._task, advance=nbytes, description=name)


def columns() -> tuple[ProgressColumn, ...]:
    return (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            AverageTokensPerSecond(), SteadyTimeLeft())  # fmt: skip


@contextmanager
def calibrate_progress() -> Iterator[_CalibrateProgress | None]:
    """A transient bar while stderr is an interactive terminal; None (nothing) otherwise."""
    err = console(sys.stderr)
    if not err.is_interactive:
        yield None
        return
    with Progress(*columns(), console=err, transient=True) as progress:
        yield _CalibrateProgress(progress)
