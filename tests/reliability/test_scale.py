"""Scale: 50,000 tiny tensors through quantize, dequantize, inspect and compare (issue 9.18).

Not a speed test (figures are in docs/performance.md): the bound is several times
what each command costs here, and only catches work that grows with the square of the tensor
count (compare took minutes for 40,000 tensors when it rebuilt a set per tensor). CPU time,
not wall time, so a busy machine does not fail it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from qtool.cli import app

TENSORS = 50_000
CPU_BOUND_S = 40.0  # about 3x the slowest command here; the quadratic compare took 64 s


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of TENSORS tensors: half 2x2 weights, half 2-element biases."""
    directory = tmp_path_factory.mktemp("scale")
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(TENSORS // 2, 2, 2, generator=gen)
    biases = torch.randn(TENSORS // 2, 2, generator=gen)
    tensors = {f"layer.{i}.weight": weights[i].clone() for i in range(TENSORS // 2)}
    tensors |= {f"layer.{i}.bias": biases[i].clone() for i in range(TENSORS // 2)}
    save_file(tensors, directory / "m.safetensors")
    return directory


def _run(*args: str) -> dict[str, Any]:
    started = time.process_time()
    result = CliRunner().invoke(app, [*args, "--json"])
    cpu = time.process_time() - started
    assert result.exit_code == 0, result.stderr
    assert cpu < CPU_BOUND_S, f"{args[0]}: {cpu:.1f} s of CPU for {TENSORS} tensors"
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def test_fifty_thousand_tiny_tensors_in_every_command(tiny: Path) -> None:
    m, q, r = (str(tiny / n) for n in ("m.safetensors", "q.safetensors", "r.safetensors"))
    quantized = _run("quantize", m, "-o", q)
    assert quantized["totals"]["tensors"] == TENSORS
    assert quantized["totals"]["quantized"] == TENSORS // 2
    restored = _run("dequantize", q, "-o", r)
    assert len(restored["tensors"]) == TENSORS
    assert sum(t["restored"] for t in restored["tensors"]) == TENSORS // 2
    inspected = _run("inspect", q)
    assert inspected["totals"]["tensors"] == TENSORS
    assert sum("quantization" in t for t in inspected["tensors"]) == TENSORS // 2
    compared = _run("compare", m, q)
    assert compared["totals"]["compared"] == TENSORS
    assert compared["totals"]["mismatches"] == 0
