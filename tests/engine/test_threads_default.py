"""compare and dequantize run torch on the idle cores (engine/threads.py), as eval does: on 2
busy cores torch's default of 2 threads took compare of SmolLM2 against its int4 export
218-280 s (46-49 s of CPU) where 1 thread took 13 s (2.9 s of CPU). The load average and the
affinity mask are faked; the count is read inside the command's work, and the caller's count
comes back afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from qtool import api
from qtool.engine import compare, restore, threads


@pytest.fixture
def busy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """2 cores at a load average of 9.5; torch starts on 2 threads."""
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (9.5, 9.5, 9.5))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    save_file({"w": torch.randn(8, 32)}, tmp_path / "m.safetensors")
    api.quantize(tmp_path / "m.safetensors", tmp_path / "q.safetensors", api.QuantizeOptions())
    return tmp_path / "m.safetensors", tmp_path / "q.safetensors"


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    seen: list[int] = []
    real = getattr(module, name)

    def spy(*args: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args)

    monkeypatch.setattr(module, name, spy)
    return seen


def test_compare_on_the_idle_cores(
    busy: None, pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _spy(monkeypatch, compare, "_compare_one")
    api.compare(*pair)
    assert seen == [1]
    assert torch.get_num_threads() == 2


def test_dequantize_on_the_idle_cores(
    busy: None, pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen = _spy(monkeypatch, restore, "_write")
    api.dequantize(pair[1], tmp_path / "r.safetensors")
    assert seen == [1]
    assert torch.get_num_threads() == 2
