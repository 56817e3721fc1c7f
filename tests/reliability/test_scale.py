"""Scale: 50,000 tiny tensors through quantize, dequantize, inspect and compare (issue 9.18).

Not a speed test (figures are in docs/performance.md): each command runs on 5,000 and on
50,000 tensors in the same minute, and the CPU time may grow at most GROWTH times for 10 times
the tensors. That catches work that grows with the square of the tensor count (compare took
minutes for 40,000 tensors when it rebuilt a set per tensor: 100x) whatever the machine's
speed; an absolute bound did not (compare costs 21-47 s of CPU here, depending on what the
neighbours on the shared cores do). CPU time, not wall time, so a busy machine does not fail it.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from qtool.cli import app

TENSORS = 50_000
GROWTH = 15.0  # linear work grew 8-10x here; the set-per-tensor compare would grow ~20x
MIN_SMALL_S = 0.5  # inspect of 5,000 tensors takes 0.2 s: noise, not a base to grow from


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


def every_command(directory: Path) -> dict[str, tuple[float, dict[str, Any]]]:
    """quantize, dequantize, inspect and compare of directory's checkpoint: (CPU s, JSON)."""
    m, q, r = (str(directory / n) for n in ("m.safetensors", "q.safetensors", "r.safetensors"))
    return {
        "quantize": _run("quantize", m, "-o", q),
        "dequantize": _run("dequantize", q, "-o", r),
        "inspect": _run("inspect", q),
        "compare": _run("compare", m, q),
    }


def _run(*args: str) -> tuple[float, dict[str, Any]]:
    """CPU seconds and JSON of `qtool ARGS --json`, with the cyclic garbage collector paused as
    qtool.cli.app.main pauses it (left on, it walks the growing heap: superlinear)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        started = time.process_time()
        result = CliRunner().invoke(app, [*args, "--json"])
        cpu = time.process_time() - started
    finally:
        if collecting:
            gc.enable()
    assert result.exit_code == 0, result.stderr
    doc: dict[str, Any] = json.loads(result.stdout)
    return cpu, doc


def test_fifty_thousand_tiny_tensors_in_every_command(tmp_path: Path) -> None:
    small = every_command(write_tiny(tmp_path / "small", TENSORS // 10))
    large = every_command(write_tiny(tmp_path / "large", TENSORS))
    for command, (cpu, _) in large.items():
        growth = cpu / max(small[command][0], MIN_SMALL_S)
        assert growth < GROWTH, (
            f"{command}: {cpu:.1f} s of CPU for {TENSORS} tensors, {growth:.0f}x"
        )
    quantized, restored = large["quantize"][1], large["dequantize"][1]
    inspected, compared = large["inspect"][1], large["compare"][1]
    assert quantized["totals"]["tensors"] == TENSORS
    assert quantized["totals"]["quantized"] == TENSORS // 2
    assert len(restored["tensors"]) == TENSORS
    assert sum(t["restored"] for t in restored["tensors"]) == TENSORS // 2
    assert inspected["totals"]["tensors"] == TENSORS
    assert sum("quantization" in t for t in inspected["tensors"]) == TENSORS // 2
    assert compared["totals"]["compared"] == TENSORS
    assert compared["totals"]["mismatches"] == 0
