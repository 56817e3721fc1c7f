"""How many CPU threads eval, calibrate, compare and dequantize run torch on, set once for torch
and for numba's kernels together (quantize keeps its own: `--threads`, else every core,
except a calibrated method's forward passes, which take this default too).

A thread count above the cores that are free costs far more than one below: every torch
operation ends in a barrier, and a thread that shares its core with another process stalls the
others at each one (eval of SmolLM2 on 2 cores at a load average of 5-11: 34-57 s with 2
threads, 11-15 s with 1). So the default is the cores this process may run on, less the busy
ones by the last minute's load average (rounded to the nearest, at least 1): all of them on an
idle machine, one on a busy one. A user's `--threads N` is taken as given.

numba's parallel kernels (that dequantize a GGUF, or measure compare's errors) follow the same
count: numerics.fused.set_threads and gguf/fast.py cap numba's count at torch's before each
kernel, and numerics/numba_pool.py keeps numba's pool from resetting torch's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def cores() -> int:
    """The CPUs this process may run on (its affinity mask, as a container or taskset sets it)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average, or None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def free_cores(available: int, load: float | None) -> int:
    """`available` cores less the busy ones (`load`: runnable tasks on average), at least 1."""
    if load is None:
        return available
    return max(1, min(available, round(available - load)))


def default_threads() -> int:
    return free_cores(cores(), load_average())


@contextmanager
def using_threads(threads: int | None) -> Iterator[int]:
    """torch's operations (and numba's kernels, which follow torch's count) on `threads`, or on
    default_threads() when None, until the block ends (an in-process caller gets its own count
    back); yields the count set."""
    count = threads if threads is not None else default_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)
