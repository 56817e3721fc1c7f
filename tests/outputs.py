"""Helpers shared by the tests of what qtool writes (tests/reliability/): the compressed-tensors
format flag, the shape of a one-line error, temp and old names left beside an output, and a
float checkpoint to quantize."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

CT = ("--format", "compressed-tensors")
EXHAUSTIVE = os.environ.get("QTOOL_EXHAUSTIVE") == "1"
ERROR_LINE = re.compile(r"^qtool: error: .+\n$")


def leftovers(parent: Path) -> list[str]:
    """Temp and old names of outputs left in `parent` (a clean run leaves none)."""
    return [p.name for p in parent.iterdir() if ".qtool-tmp-" in p.name or ".qtool-old-" in p.name]


def snapshot(directory: Path) -> dict[str, bytes]:
    """The content of every file below `directory`, by path."""
    return {str(p): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def checkpoint(path: Path, tensors: int = 8, rows: int = 256, cols: int = 128) -> None:
    """A float32 safetensors file of `tensors` (rows, cols) weights and their biases."""
    gen = torch.Generator().manual_seed(1)
    save_file(
        {f"layer.{i}.weight": torch.randn(rows, cols, generator=gen) for i in range(tensors)}
        | {f"layer.{i}.bias": torch.randn(rows, generator=gen) for i in range(tensors)},
        path,
    )
