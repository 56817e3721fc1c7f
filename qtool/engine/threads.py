"""How many CPU threads quantize, eval, calibrate, compare and dequantize run torch on, set once
for torch and for numba's kernels together. A user's `--threads N` is taken as given.

A thread count above the cores that are free costs far more than one below: every torch
operation ends in a barrier, and a thread that shares its core with another process stalls the
others at each one (eval of SmolLM2 on 2 cores at a load average of 5-11: 34-57 s with 2
threads, 11-15 s with 1). quantize gains nothing from a second thread either (SmolLM2 int4 g64
on 2 cores at load 1-2: 2.8-7.0 s with 1 thread, 4.1-10.5 s with 2), so it takes the same
default. The default is the cores this process may use (its affinity mask, capped by a
cgroup's CPU quota as a container sets it), less the busy ones: the last minute's load average
is host-wide, so only this process's share of it counts (load x cores / the host's CPUs),
rounded to the nearest, at least 1: all of them on an idle machine, one on a busy one.

numba's parallel kernels (that dequantize a GGUF, or measure compare's errors) follow the same
count: numerics.fused.set_threads and gguf/fast.py cap numba's count at torch's before each
kernel, and numerics/numba_pool.py keeps numba's pool from resetting torch's."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# cgroup v2's one file ("max 100000" or "200000 100000"), then v1's two
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CFS_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CFS_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def cores() -> int:
    """The CPUs this process may run on: its affinity mask (as taskset or a cpuset sets it),
    capped by the cgroup's CPU quota (as `docker --cpus` sets it), at least 1."""
    try:
        mask = len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        mask = os.cpu_count() or 1
    quota = cpu_quota()
    return max(1, min(mask, math.ceil(quota))) if quota is not None else mask


def cpu_quota() -> float | None:
    """The cgroup's CPU quota in cores (1.5 for 150 ms per 100 ms), or None where none is set
    or it cannot be read."""
    try:
        if CPU_MAX.exists():
            quota, period = CPU_MAX.read_text().split()[:2]
        else:
            quota, period = CFS_QUOTA.read_text().strip(), CFS_PERIOD.read_text().strip()
        if quota in ("max", "-1"):
            return None
        share = int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None
    return share if share > 0 else None


def load_average() -> float | None:
    """The 1-minute load average, or None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def free_cores(available: int, load: float | None, host: int | None = None) -> int:
    """`available` cores less the busy ones, at least 1. `load` (runnable tasks on average) is
    the host's, spread over its `host` CPUs (None: as many as `available`): this process's
    cores carry their share of it."""
    if load is None:
        return available
    busy = load * available / host if host and host > available else load
    return max(1, min(available, round(available - busy)))


def default_threads() -> int:
    return free_cores(cores(), load_average(), os.cpu_count())


@contextmanager
def using_threads(threads: int | None) -> Iterator[int]:
    """torch's operations (and numba's kernels, which follow torch's count) on `threads`, or on
    default_threads() when None, until the block ends (an in-process caller gets its own count
    back); yields the count set."""
    import torch  # here: a caller that only counts cores never waits for torch

    count = threads if threads is not None else default_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)
