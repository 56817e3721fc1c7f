"""compare's error figures of two float tensors in one parallel pass (numba): the same chunk sums
as metrics.error_stats (numerics/metrics.py's definition, fused_sums.chunk_sums), without the
torch path's float64 copies and folds (41 of compare's 72-95 s on SmolLM2 against its int4
export, issue 33).

Importing this module imports numba; numerics/select.py decides whether that happens.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import prange

from qtool.numerics.fused import layout, set_threads, tensor_words
from qtool.numerics.fused_sums import CHUNK, chunk_span, chunk_sums, key_value
from qtool.numerics.fused_words import to_f32
from qtool.numerics.metrics import exact_sum
from qtool.results import ErrorStats


@numba.njit(parallel=True, cache=True, fastmath=False)
def _pair_sums(xw, yw, lay, parts, kmax):  # type: ignore[no-untyped-def]  # numba types it
    """Chunk c of A's words xw and B's yw: parts[0][c] = sum x^2, parts[1][c] = sum e^2 with
    e = float32(x) - float32(y) in float32; kmax[t]: the largest |e| key of thread t's chunks."""
    n = xw.size
    chunks = lay[3]
    nch = kmax.size
    for t in prange(nch):
        es = np.empty(CHUNK, np.float32)
        buf = np.empty(CHUNK // 2, np.float64)
        km = np.int32(0)
        for c in range(t * chunks // nch, (t + 1) * chunks // nch):
            a, b = chunk_span(c, lay, n)
            for i in range(a, b):
                es[i - a] = to_f32(xw[i]) - to_f32(yw[i])  # type: ignore[no-untyped-call]
            km = max(km, chunk_sums(xw[a:b], es, b - a, buf, c, parts))
        kmax[t] = km


def error_stats(x: torch.Tensor, y: torch.Tensor) -> ErrorStats | None:
    """metrics.error_stats(x, y) of two CPU float tensors of one shape; None when it is not
    finite (the torch path then measures it again, in float64 where float32 overflowed)."""
    shape = tuple(x.shape)
    lay = layout(shape)
    parts = (np.zeros(lay[3]), np.zeros(lay[3]))
    set_threads(torch.get_num_threads())
    kmax = np.zeros(max(1, min(lay[3], 256)), np.int32)
    if x.numel():
        _pair_sums(tensor_words(x.reshape(-1)), tensor_words(y.reshape(-1)), lay, parts, kmax)
    stats = ErrorStats(
        numel=x.numel(),
        sq_error=exact_sum(parts[1].tolist()),
        sq_signal=exact_sum(parts[0].tolist()),
        max_abs=key_value(kmax),
    )
    finite = all(math.isfinite(v) for v in (stats.sq_error, stats.sq_signal, stats.max_abs))
    return stats if finite else None
