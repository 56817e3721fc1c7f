"""scripts/dither_checkpoint.py: the stand-in checkpoint's weights leave the Q4_1 grid they sat
on, by less than half a step of their block, the same for the same seed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

SCRIPT = Path(__file__).parents[2] / "scripts" / "dither_checkpoint.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dither_checkpoint", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _on_q4_1_grid(rows: int, cols: int) -> torch.Tensor:
    """A weight whose every block of 32 holds exactly the 16 levels of Q4_1 (min + k x step)."""
    gen = torch.Generator().manual_seed(1)
    lo = torch.randn(rows, cols // 32, 1, generator=gen)
    step = torch.rand(rows, cols // 32, 1, generator=gen) + 0.5
    levels = torch.randint(0, 16, (rows, cols // 32, 32), generator=gen).float()
    levels[..., 0], levels[..., 1] = 0, 15  # every block spans its min to its max
    return (lo + levels * step).reshape(rows, cols)


def test_dither_leaves_the_grid_within_half_a_step_and_repeats() -> None:
    dither = _script().dither
    w = _on_q4_1_grid(8, 64)
    out = dither(w, torch.Generator().manual_seed(0))
    blocks = w.reshape(8, 2, 32)
    step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15
    moved = (out - w).reshape(8, 2, 32).abs()
    assert bool((moved <= step / 2 + 1e-6).all())
    # off the grid: on average a quarter step from the nearest level, not 0
    off = (out.reshape(8, 2, 32) - blocks.amin(-1, keepdim=True)) / step
    assert float((off - off.round()).abs().mean()) > 0.15
    assert torch.equal(out, dither(w, torch.Generator().manual_seed(0)))
    assert not torch.equal(out, dither(w, torch.Generator().manual_seed(1)))
