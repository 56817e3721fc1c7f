"""compare's error figures through the fused kernels (numerics/fused_compare.py): the same
numbers as metrics.error_stats, bit for bit, for every chunk layout and dtype pair, and the
path compare takes once the fused kernels are loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("numba")

from qtool.engine import compare  # noqa: E402
from qtool.numerics import fused_compare  # noqa: E402
from qtool.numerics.metrics import error_stats  # noqa: E402

SHAPES = [(), (7,), (3, 5), (64, 576), (1, 3000), (5, 2049), (100, 1024), (2, 3, 4), (0, 5)]
PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.float64, torch.bfloat16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("da", "db"), PAIRS, ids=str)
def test_same_figures_as_the_definition(
    shape: tuple[int, ...], da: torch.dtype, db: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=gen).to(da)
    y = (x.float() + 0.01 * torch.randn(shape, generator=gen)).to(db)
    assert fused_compare.error_stats(x, y) == error_stats(x, y)


def test_not_finite_is_left_to_the_torch_path() -> None:
    """float32 overflow (measured again in float64 by metrics) and NaN: None, never a figure."""
    big = torch.tensor([3e38, -3e38])
    assert fused_compare.error_stats(big, -big) is None
    assert fused_compare.error_stats(torch.tensor([1.0, float("nan")]), torch.ones(2)) is None


def test_compare_runs_the_fused_sums_once_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(64, 576, generator=gen), "b": torch.randn(576, generator=gen)}
    b = {k: v + 0.01 for k, v in a.items()}
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    monkeypatch.setenv("QTOOL_KERNEL", "torch")
    reference = compare.compare_files(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    calls: list[str] = []
    real = fused_compare.error_stats

    def spy(x: torch.Tensor, y: torch.Tensor) -> object:
        calls.append(str(tuple(x.shape)))
        return real(x, y)

    monkeypatch.setattr(fused_compare, "error_stats", spy)
    monkeypatch.setenv("QTOOL_KERNEL", "fused")
    fused = compare.compare_files(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert sorted(calls) == ["(576,)", "(64, 576)"]
    assert fused.rows == reference.rows
