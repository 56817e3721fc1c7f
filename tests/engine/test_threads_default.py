"""quantize, compare and dequantize run torch on the idle cores (engine/threads.py), as eval
does: on 2 busy cores torch's default of 2 threads took compare of SmolLM2 against its int4
export 218-280 s (46-49 s of CPU) where 1 thread took 13 s (2.9 s of CPU). The idle cores are
those of the affinity mask under the cgroup's CPU quota, less this process's share of the
host's load. The load average, the affinity mask and the cgroup files are faked; the count is
read inside the command's work, and the caller's count comes back afterwards."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from qtool import api
from qtool.engine import compare, loop, restore, threads
from tests.conftest import Invoke


@pytest.fixture
def no_quota(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No cgroup file: the machine running the tests sets no quota for these tests."""
    for name in ("CPU_MAX", "CFS_QUOTA", "CFS_PERIOD"):
        monkeypatch.setattr(threads, name, tmp_path / "absent" / name)


@pytest.fixture
def busy(monkeypatch: pytest.MonkeyPatch, no_quota: None) -> Iterator[None]:
    """2 cores of 2 at a load average of 9.5; torch starts on 2 threads."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (9.5, 9.5, 9.5))
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


@pytest.mark.parametrize(("more", "expected"), [((), 1), (("--threads", "2"), 2)])
def test_quantize_on_the_idle_cores_unless_told(
    busy: None,
    tmp_path: Path,
    invoke: Invoke,
    monkeypatch: pytest.MonkeyPatch,
    more: tuple[str, ...],
    expected: int,
) -> None:
    """quantize defaulted to every core (os.cpu_count()) while the other commands took the
    idle ones; the count is read where the shard's tensors are quantized, and the caller's
    comes back."""
    save_file({"w": torch.randn(8, 32), "v": torch.randn(4, 32)}, tmp_path / "m.safetensors")
    seen = _spy(monkeypatch, loop, "write_shard")
    rc, _, err = invoke(
        "quantize", str(tmp_path / "m.safetensors"), "-o", str(tmp_path / "q.safetensors"), *more
    )
    assert rc == 0, err
    assert seen == [expected]
    assert torch.get_num_threads() == 2


def _cgroup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **files: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        monkeypatch.setattr(threads, name, tmp_path / name)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"CPU_MAX": "150000 100000\n"}, 2),  # cgroup v2, 1.5 CPUs: 2 threads share them
        ({"CPU_MAX": "100000 100000\n"}, 1),
        ({"CPU_MAX": "max 100000\n"}, 8),
        ({"CFS_QUOTA": "300000\n", "CFS_PERIOD": "100000\n"}, 3),  # cgroup v1
        ({"CFS_QUOTA": "-1\n", "CFS_PERIOD": "100000\n"}, 8),
        ({"CPU_MAX": "garbage\n"}, 8),  # unreadable: the affinity mask alone
        ({"CPU_MAX": "2000000 100000\n"}, 8),  # a quota above the mask: the mask
    ],
)
def test_cores_are_capped_by_the_cgroup_quota(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    no_quota: None,
    files: dict[str, str],
    expected: int,
) -> None:
    """A container given 1 CPU of a host's 8 (`docker --cpus 1`) ran 8 threads: the affinity
    mask still lists every CPU, only the cgroup's quota says how much of them it may use."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    _cgroup(monkeypatch, tmp_path, **files)
    assert threads.cores() == expected


@pytest.mark.parametrize(
    ("available", "load", "host", "expected"),
    [
        (8, 10.0, 64, 7),  # 10 busy of 64: about 1.25 on this process's 8
        (8, 60.0, 64, 1),
        (2, 9.5, 2, 1),  # the whole host: its load as it is
        (2, 0.4, 2, 2),
        (4, 3.6, None, 1),  # host unknown: the load counts in full
    ],
)
def test_only_this_process_share_of_the_host_load_is_busy(
    available: int, load: float, host: int | None, expected: int
) -> None:
    """The load average counts the whole host's runnable tasks: a process pinned to 8 of 64
    CPUs at a host load of 10 ran 1 thread, as if its own 8 cores carried all of it."""
    assert threads.free_cores(available, load, host) == expected


def test_the_default_reads_the_mask_the_quota_and_the_load_together(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_quota: None
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "getloadavg", lambda: (16.0, 16.0, 16.0))
    _cgroup(monkeypatch, tmp_path, CPU_MAX="400000 100000\n")
    assert threads.default_threads() == 3  # 4 cores of quota, 4 x 16 / 64 = 1 busy
