"""Scale: work grows linearly with the tensor count in quantize, dequantize, inspect and compare.

Not a speed test (timings are scripts/bench.py's and docs/performance.md's): each command runs on
SMALL and on 10 times as many tiny tensors, and the lines of qtool's own code it executes may
grow at most GROWTH times. A line count is the same on a busy machine as on an idle one, and
it sees the loops inside qtool's comprehensions: compare once rebuilt a set of the names per
tensor (`set(left.names)`, a comprehension over every entry), which took minutes for 40,000
tensors and counts 70x here. Work done inside C (torch, a builtin's loop over a list given to
it) is not counted; the per-tensor paths that call into it are.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import qtool
from qtool.cli import app

pytestmark = pytest.mark.slow

SMALL = 500
LARGE = 10 * SMALL
GROWTH = 12.0  # linear grew 9.9x here (constant start-up work); the per-tensor set 70x
QTOOL_DIR = str(Path(qtool.__file__).parent)


def write_tiny(directory: Path, count: int) -> Path:
    """A checkpoint of `count` tensors: half 2x2 weights, half 2-element biases."""
    directory.mkdir()
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(count // 2, 2, 2, generator=gen)
    biases = torch.randn(count // 2, 2, generator=gen)
    tensors = {f"layer.{i}.weight": weights[i].clone() for i in range(count // 2)}
    tensors |= {f"layer.{i}.bias": biases[i].clone() for i in range(count // 2)}
    save_file(tensors, directory / "m.safetensors")
    return directory


class LineCounter:
    """Counts the lines executed in qtool's modules (every thread started while it runs too);
    other code is not traced at all, so torch and the standard library cost one call each."""

    def __init__(self) -> None:
        self.lines = 0

    def __enter__(self) -> LineCounter:
        threading.settrace(self._call)
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)
        threading.settrace(None)

    def _call(self, frame: FrameType, event: str, arg: object) -> Any:
        return self._line if frame.f_code.co_filename.startswith(QTOOL_DIR) else None

    def _line(self, frame: FrameType, event: str, arg: object) -> Any:
        if event == "line":  # also each pass of a loop back to its head, in comprehensions too
            self.lines += 1
        return self._line


def every_command(directory: Path, counted: bool = True) -> dict[str, tuple[int, dict[str, Any]]]:
    """quantize, dequantize, inspect and compare of directory's checkpoint: (lines, JSON)."""
    m, q, r = (str(directory / n) for n in ("m.safetensors", "q.safetensors", "r.safetensors"))
    return {
        "quantize": _run(counted, "quantize", m, "-o", q),
        "dequantize": _run(counted, "dequantize", q, "-o", r),
        "inspect": _run(counted, "inspect", q),
        "compare": _run(counted, "compare", m, q),
    }


def _run(counted: bool, *args: str) -> tuple[int, dict[str, Any]]:
    """Lines of qtool executed by `qtool ARGS --json`, and its JSON; with the cyclic garbage
    collector paused as qtool.cli.app.main pauses it."""
    collecting = gc.isenabled()
    gc.disable()
    counter = LineCounter()
    try:
        if counted:
            with counter:
                result = CliRunner().invoke(app, [*args, "--json"])
        else:
            result = CliRunner().invoke(app, [*args, "--json"])
    finally:
        if collecting:
            gc.enable()
    assert result.exit_code == 0, result.stderr
    doc: dict[str, Any] = json.loads(result.stdout)
    return counter.lines, doc


def test_work_grows_linearly_with_the_tensor_count(tmp_path: Path) -> None:
    every_command(write_tiny(tmp_path / "warm", 20), counted=False)  # imports, caches: once
    small = every_command(write_tiny(tmp_path / "small", SMALL))
    large = every_command(write_tiny(tmp_path / "large", LARGE))
    for command, (lines, _) in large.items():
        assert small[command][0] > SMALL, f"{command}: the counter saw no per-tensor work"
        growth = lines / small[command][0]
        assert growth < GROWTH, (
            f"{command}: {lines:,} lines of qtool for {LARGE:,} tensors, "
            f"{small[command][0]:,} for {SMALL:,}: {growth:.1f}x"
        )
    quantized, restored = large["quantize"][1], large["dequantize"][1]
    inspected, compared = large["inspect"][1], large["compare"][1]
    assert quantized["totals"]["tensors"] == LARGE
    assert quantized["totals"]["quantized"] == LARGE // 2
    assert len(restored["tensors"]) == LARGE
    assert sum(t["restored"] for t in restored["tensors"]) == LARGE // 2
    assert inspected["totals"]["tensors"] == LARGE
    assert sum("quantization" in t for t in inspected["tensors"]) == LARGE // 2
    assert compared["totals"]["compared"] == LARGE
    assert compared["totals"]["mismatches"] == 0
