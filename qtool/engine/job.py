"""What one quantize run is: its mode, how it goes, what it reads and writes (torch-free)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.engine.layout import Target
from qtool.engine.plan import ModelPlan, QuantizeOptions
from qtool.engine.shards import Shards
from qtool.engine.source import Source
from qtool.formats.base import OutputFormat
from qtool.results import Progress, QuantizeRow

if TYPE_CHECKING:
    from qtool.engine.loop import Kernels


class Mode(str, enum.Enum):
    """What a run does after planning from the headers.

    plan:     nothing more: the plan a dry run prints (no tensor read; no torch for safetensors)
    estimate: reads the data: the plan's data passes, then each tensor quantized and measured;
              nothing written (a dry run with --estimate)
    write:    checks every output, then the data passes, then streams each shard through the
              format's writer; outputs appear only complete
    """

    PLAN = "plan"
    ESTIMATE = "estimate"
    WRITE = "write"


@dataclass(frozen=True)
class RunOptions:
    """How a quantize run goes (what it does to the tensors is QuantizeOptions). `also`: files
    the caller writes afterwards (a plot), checked with the run's outputs."""

    mode: Mode = Mode.WRITE
    device: str = "auto"
    force: bool = False
    progress: Progress | None = None
    also: Sequence[Path] = ()
    threads: int | None = None  # torch's CPU threads, set once the checks passed (None: idle cores)


@dataclass(frozen=True)
class Job:
    """One run: what it reads and where it writes (`target` as the summary names it: a directory
    by its final name, built under a temporary one), its format, options and shards; `kernels`
    None in a plan."""

    source: Source
    target: Target
    fmt: OutputFormat
    options: QuantizeOptions
    run: RunOptions
    shards: Shards
    kernels: Kernels | None


@dataclass(frozen=True)
class Done:
    """What a run did: the final plan, a row per tensor, and what it has to say."""

    plan: ModelPlan
    rows: list[QuantizeRow]
    notes: list[str] = field(default_factory=list)
    stale_temps_removed: int = 0
