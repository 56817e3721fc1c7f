"""quantize --method runs its forward passes on the idle cores (engine/threads.py), as eval and
calibrate do, unless --threads says otherwise: quantize's every-core default made the method's
passes stall each other on a busy machine. The affinity mask, the core count and the load
average are faked; the count is read inside the pass itself."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Invoke

pytest.importorskip("transformers")

import torch  # noqa: E402

from qtool.engine.calibrate import sequential  # noqa: E402
from qtool.engine.methods import run as method_run  # noqa: E402

TINY_LM = Path(__file__).parents[2] / "sample_weights" / "tiny-lm"
TEXT = " ".join(f"alpha {i} beta {i * 7 % 13} gamma." for i in range(80))


@pytest.fixture
def busy(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """4 cores at a load average of 3.6 (one idle); torch starts on 2 threads. Yields the
    thread counts the method's pass ran on."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "getloadavg", lambda: (3.6, 3.6, 3.6))
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    seen: list[int] = []
    real = sequential.run_sequential

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(method_run, "run_sequential", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield seen
    torch.set_num_threads(before)


@pytest.mark.parametrize(("more", "expected"), [((), 1), (("--threads", "3"), 3)])
def test_the_methods_passes_run_on_the_idle_cores_unless_told(
    tmp_path: Path, invoke: Invoke, busy: list[int], more: tuple[str, ...], expected: int
) -> None:
    (tmp_path / "calib.txt").write_text(TEXT)
    rc, _, err = invoke(
        "quantize", str(TINY_LM), "--method", "gptq", "--text", str(tmp_path / "calib.txt"),
        "--tokens", "128", "--ctx", "32", "--dtype", "int4", "--group-size", "16",
        "-o", str(tmp_path / "out"), *more,
    )  # fmt: skip
    assert rc == 0, err
    assert busy == [expected]
