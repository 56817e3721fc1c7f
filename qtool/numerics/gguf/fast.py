"""The fused GGUF kernels (numba: numerics/gguf/jit*.py) and when they run instead of torch's.

QTOOL_KERNEL chooses as it does for the integer kernels (numerics/select.py): `torch` always
the torch kernels; `fused` these for every CPU tensor (a usage error naming the extra to
install when numba cannot be loaded); `auto` (default) these for CPU tensors when numba is
installed and the work would take the torch kernels longer than loading numba does (about a
second), or numba is loaded already. Both give the same bytes (tests/numerics/test_gguf_fast.py),
so the choice shows only in the time. CUDA tensors always run the torch kernels.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import torch

from qtool.errors import UsageError
from qtool.numerics import metrics, numba_pool, select
from qtool.results import ErrorStats

LEGACY = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4}
K_QUANTIZE = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 0}
K_DEQUANTIZE = {"Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
QUANTIZE_TYPES = (*LEGACY, *K_QUANTIZE)
DEQUANTIZE_TYPES = (*LEGACY, *K_DEQUANTIZE)

SLAB = 1 << 16  # jit.error_sums' slab
LOAD_SECONDS = 1.0  # import numba and load the cached kernels (docs/performance.md)
# bytes of float32 per second the torch kernels manage on one core (scripts/bench_gguf.py)
TORCH_RATE = {"K": 2e6, "legacy": 40e6, "dequantize": 50e6}


class _Loader:
    """Imports the numba kernels at most once per process."""

    def __init__(self) -> None:
        self.modules: dict[str, ModuleType] | None = None
        self.error: BaseException | None = None
        self.tried = False

    def load(self) -> dict[str, ModuleType] | None:
        if not self.tried:
            self.tried = True
            try:
                self.modules = {
                    name: importlib.import_module(f"qtool.numerics.gguf.{name}")
                    for name in ("jit", "jit_k", "jit_q6k", "jit_deq_k", "jit_w")
                }
            except Exception as err:  # a broken numba leaves the torch kernels in charge
                self.error = err
        return self.modules

    def now(self) -> dict[str, ModuleType]:
        modules = self.load()
        if modules is None:
            why = f"numba cannot be loaded ({type(self.error).__name__}: {self.error})"
            raise UsageError(
                None, f"{select.ENV}=fused: {why}; install it with {select.INSTALL_HINT}, "
                f"or unset {select.ENV}",
            )  # fmt: skip
        return modules


_LOADER = _Loader()


def torch_seconds(qtype: str, n_floats: int, quantize: bool) -> float:
    """About how long the torch kernels take for n_floats elements of `qtype`."""
    if not quantize:
        rate = TORCH_RATE["dequantize"]
    else:
        rate = TORCH_RATE["K" if qtype in K_QUANTIZE else "legacy"]
    return 4 * n_floats / rate


def expect(seconds: float) -> None:
    """Told up front how long a whole run would take the torch kernels: loads numba now when
    that is worth it (or QTOOL_KERNEL=fused asks for it), so every tensor of the run uses it."""
    kernel = select.requested()
    if kernel is select.Kernel.FUSED:
        _LOADER.now()
    elif kernel is select.Kernel.AUTO and seconds >= LOAD_SECONDS and select.numba_installed():
        _LOADER.load()


def chosen(
    qtype: str,
    device: torch.device,
    n_floats: int,
    quantize: bool,
    kernel: select.Kernel | None = None,
) -> bool:
    """Whether this call runs the fused kernels (`kernel`: QTOOL_KERNEL's choice by default)."""
    covered = QUANTIZE_TYPES if quantize else DEQUANTIZE_TYPES
    kernel = kernel or select.requested()
    if kernel is select.Kernel.TORCH or device.type != "cpu" or qtype not in covered:
        return False
    if kernel is select.Kernel.FUSED:
        return _LOADER.now() is not None
    if _LOADER.modules is None and not _LOADER.tried:
        expect(torch_seconds(qtype, n_floats, quantize))
    return _LOADER.modules is not None


WEIGHTED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
"""The types the fused kernels quantize with quant_weights (jit_w.py): all that take them."""


def chosen_weighted(
    qtype: str, device: torch.device, n_floats: int, kernel: select.Kernel | None = None
) -> bool:
    """Whether quantize with quant_weights runs the fused kernels (as `chosen`; the torch
    kernels' rate is the K-quants')."""
    kernel = kernel or select.requested()
    if kernel is select.Kernel.TORCH or device.type != "cpu" or qtype not in WEIGHTED_TYPES:
        return False
    if kernel is select.Kernel.FUSED:
        return _LOADER.now() is not None
    if _LOADER.modules is None and not _LOADER.tried:
        expect(4 * n_floats / TORCH_RATE["K"])
    return _LOADER.modules is not None


def quantize_weighted(rows: torch.Tensor, qw: torch.Tensor, qtype: str, width: int) -> torch.Tensor:
    """(r, width) uint8 of float32 CPU rows (r, n) with quant_weights qw (n,), by jit_w."""
    jit = _LOADER.now()
    _threads()
    x = np.ascontiguousarray(rows.detach().numpy())
    w = np.ascontiguousarray(qw.detach().numpy())
    out = np.empty((x.shape[0], width), dtype=np.uint8)
    if x.shape[0]:
        jit["jit_w"].quantize_weighted(x, w, out, jit["jit_w"].KINDS[qtype])
    return torch.from_numpy(out)


def _threads() -> None:
    import numba

    numba_pool.start()
    n = max(1, min(torch.get_num_threads(), vars(numba.config)["NUMBA_NUM_THREADS"]))
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)


def quantize(blocks: torch.Tensor, qtype: str, type_size: int) -> torch.Tensor:
    """(n, type_size) uint8 of float32 CPU blocks (n, block_size), by the numba kernels."""
    jit = _LOADER.now()
    _threads()
    x = np.ascontiguousarray(blocks.detach().numpy())
    out = np.empty((x.shape[0], type_size), dtype=np.uint8)
    if x.shape[0]:
        if qtype in LEGACY:
            jit["jit"].quantize_legacy(x, out, LEGACY[qtype])
        elif qtype == "Q6_K":
            jit["jit_q6k"].quantize_q6_k(x, out)
        else:
            jit["jit_k"].quantize_q45_k(x, out, K_QUANTIZE[qtype])
    return torch.from_numpy(out)


def dequantize(blocks: torch.Tensor, qtype: str, block_size: int) -> torch.Tensor:
    """(n, block_size) float32 of uint8 CPU blocks (n, type_size), by the numba kernels."""
    jit = _LOADER.now()
    _threads()
    raw = np.ascontiguousarray(blocks.numpy())
    out = np.empty((raw.shape[0], block_size), dtype=np.float32)
    if raw.shape[0]:
        if qtype in LEGACY:
            jit["jit"].dequantize_legacy(raw, out, LEGACY[qtype])
        else:
            jit["jit_deq_k"].dequantize_k(raw, out, K_DEQUANTIZE[qtype])
    return torch.from_numpy(out)


def error_stats(x: torch.Tensor, x_hat: torch.Tensor) -> ErrorStats:
    """metrics.error_stats of float32 CPU tensors in one fused pass when numba is loaded (the
    float64 sums in another order: the same to ~1e-12 relative); else, or when a float32
    difference overflows, metrics.error_stats itself."""
    if _LOADER.modules is None or x.dtype != torch.float32 or x_hat.dtype != torch.float32:
        return metrics.error_stats(x, x_hat)
    a = np.ascontiguousarray(x.detach().reshape(-1).numpy())
    b = np.ascontiguousarray(x_hat.detach().reshape(-1).numpy())
    if a.size == 0:
        return metrics.error_stats(x, x_hat)
    slabs = np.empty(((a.size + SLAB - 1) // SLAB, 3), dtype=np.float64)
    _threads()
    _LOADER.modules["jit"].error_sums(a, b, slabs)
    top = np.int32(slabs[:, 2].max()).view(np.float32)
    if np.isinf(top):
        return metrics.error_stats(x, x_hat)
    return ErrorStats(int(a.size), float(slabs[:, 0].sum()), float(slabs[:, 1].sum()), float(top))
