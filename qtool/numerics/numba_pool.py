"""numba's thread pool beside torch's: one thread count for both (engine/threads.py picks it).

numba's parallel kernels run on the OpenMP runtime torch already loaded, and numba starting its
pool inside a kernel's first launch left that runtime's thread count at numba's pool size: torch
then ran every later operation on every core whatever `--threads` said (eval of a GGUF at
`--threads 1`: 23 s of CPU instead of 7, 3-6x the wall time on a busy machine, issue 33). So
the pool is started before the first kernel, and torch's count is set again afterwards. Each
kernel call then caps numba's own count at torch's (fused.set_threads, gguf/fast.py).

Importing this module does not import numba; start() does.
"""

from __future__ import annotations

import torch

_STARTED: list[bool] = []  # one entry once start() has run in this process


def start() -> None:
    """Start numba's thread pool now (once per process), keeping torch's thread count."""
    if _STARTED:
        return
    from numba.np.ufunc import parallel

    before = torch.get_num_threads()
    parallel._launch_threads()  # type: ignore[no-untyped-call]
    torch.set_num_threads(before)
    _STARTED.append(True)
