"""Which kernels quantize and dequantize a tensor: the torch reference or the fused CPU kernels.

QTOOL_KERNEL (environment) chooses: `auto` (default), `torch`, or `fused`.
- auto: the fused kernels for CPU tensors once they are loaded, when numba is installed and
  the run is big enough to pay for loading them (`expect`: AUTO_MIN_BYTES of tensors to
  quantize or restore). They load in a background thread (import numba, cached machine code)
  while the torch kernels handle the first tensors; both give the same bits, so which tensor
  took which path shows nowhere but in the time.
- torch: always the torch kernels (the reference, and the only CUDA path).
- fused: the fused kernels for every CPU tensor they cover, loaded at once; without numba a
  usage error naming the extra to install.
Whatever is chosen, CUDA tensors, 0-d tensors and the mse search per tensor or per channel on
an axis other than 0 run the torch kernels.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from types import ModuleType

import torch

from qtool.errors import UsageError
from qtool.numerics import kernels
from qtool.numerics.kernels import QuantizedTensor, Workspace
from qtool.spec import QSpec, RangeMethod

ENV = "QTOOL_KERNEL"
AUTO_MIN_BYTES = 64 << 20  # below this a run ends before loading numba would pay off
INSTALL_HINT = "pip install 'qtool[fast]'"


class Kernel(str, enum.Enum):
    """The kernel choice of QTOOL_KERNEL."""

    AUTO = "auto"
    TORCH = "torch"
    FUSED = "fused"


def requested() -> Kernel:
    """The choice in QTOOL_KERNEL (auto when unset or empty); a usage error for anything else."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    try:
        return Kernel(value)
    except ValueError:
        choices = ", ".join(k.value for k in Kernel)
        raise UsageError(None, f"{ENV}={value!r} is not one of {choices}") from None


def numba_installed() -> bool:
    """Whether numba can be imported (looked up, not imported)."""
    return importlib.util.find_spec("numba") is not None


class _Loader:
    """Imports the fused kernels once per process, in the foreground or in a thread, and warms
    the machine code for the first tensor's types so its first use costs no cache load."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.module: ModuleType | None = None
        self.error: BaseException | None = None
        self.planned = 0  # bytes the current run will quantize or restore on the CPU

    def now(self) -> ModuleType:
        """The fused module, imported here if it is not yet (the caller's thread waits)."""
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            if self.module is None:
                self._import()
        if self.module is None:
            raise UsageError(None, f"{ENV}=fused: {_why(self.error)}, or unset {ENV}")
        return self.module

    def start(self, warm: Callable[[ModuleType], object]) -> None:
        """Load in a background thread (once), then run `warm` (a tiny call of the kernels the
        run needs, so that their machine code is loaded before the first real tensor)."""
        with self._lock:
            if self._thread is not None or self.module is not None or self.error is not None:
                return
            self._thread = threading.Thread(
                target=self._background, args=(warm,), name="qtool-fused-load"
            )
            self._thread.start()

    def ready(self) -> ModuleType | None:
        """The fused module when it is loaded; None while it loads or when it failed."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            return None
        return self.module

    def _background(self, warm: Callable[[ModuleType], object]) -> None:
        try:
            module = importlib.import_module("qtool.numerics.fused")
            warm(module)
        except Exception as err:  # a broken numba leaves the torch kernels in charge
            self.error = err
            return
        self.module = module

    def _import(self) -> None:
        try:
            self.module = importlib.import_module("qtool.numerics.fused")
        except Exception as err:
            self.error = err


def _why(error: BaseException | None) -> str:
    """What stopped the fused kernels from loading, and what to do about it."""
    if isinstance(error, ImportError) or error is None:
        return f"numba is not installed ({error}); install it with {INSTALL_HINT}"
    if "cannot cache" in str(error):
        where = "set NUMBA_CACHE_DIR to a writable directory"
        return f"numba has nowhere to keep its cache ({error}); {where}"
    return f"the fused kernels cannot be loaded ({type(error).__name__}: {error})"


_LOADER = _Loader()


def expect(device: torch.device, nbytes: int) -> None:
    """Told at the start of a run how many bytes of tensors it will quantize or restore on
    `device`: checks QTOOL_KERNEL, and loads the fused kernels at once when they are forced."""
    if requested() is Kernel.FUSED and device.type == "cpu":
        _LOADER.now()
    _LOADER.planned = nbytes if device.type == "cpu" else 0


def _fused_for(
    device: torch.device, ndim: int, spec: QSpec, warm: Callable[[ModuleType], object]
) -> ModuleType | None:
    """The fused module when it should take this tensor, else None (torch kernels)."""
    kernel = requested()
    if kernel is Kernel.TORCH or device.type != "cpu" or ndim == 0:
        return None
    module: ModuleType | None
    if kernel is Kernel.FUSED:
        module = _LOADER.now()
    else:
        module = _LOADER.ready()
        if module is None and _LOADER.planned >= AUTO_MIN_BYTES and numba_installed():
            _LOADER.start(warm)
    if module is None or not module.supports(spec, ndim):
        return None
    module.set_threads(torch.get_num_threads())
    return module


def quantize_tensor(
    x: torch.Tensor,
    spec: QSpec,
    *,
    with_errors: bool = True,
    scale_dtype: torch.dtype = torch.float32,
    workspace: Workspace | None = None,
) -> QuantizedTensor:
    """kernels.quantize_tensor through the chosen kernels (same results, bit for bit)."""
    tiny = torch.zeros((2,) * x.ndim, dtype=x.dtype)

    def warm(module: ModuleType) -> object:
        if not module.supports(spec, tiny.ndim):
            return None
        return module.quantize_tensor(tiny, spec, scale_dtype=scale_dtype)

    module = _fused_for(x.device, x.ndim, spec, warm)
    if module is None:
        return kernels.quantize_tensor(
            x, spec, with_errors=with_errors, scale_dtype=scale_dtype, workspace=workspace
        )
    result: QuantizedTensor = module.quantize_tensor(
        x, spec, with_errors=with_errors, scale_dtype=scale_dtype
    )
    return result


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    spec: QSpec,
    dtype: torch.dtype,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """kernels.dequantize through the chosen kernels (same results, bit for bit)."""

    def warm(module: ModuleType) -> object:
        tiny = torch.zeros((2,) * len(shape), dtype=torch.float32)
        minmax = replace(spec, range_method=RangeMethod.MINMAX)
        small = module.quantize_tensor(tiny, minmax, with_errors=False)
        return module.dequantize_tensor(
            small.q, small.scale, small.zero_point, minmax, dtype, tuple(tiny.shape)
        )

    module = _fused_for(q.device, len(shape), spec, warm)
    if module is None:
        return kernels.dequantize(q, scale, zero_point, spec, dtype, shape=shape)
    out: torch.Tensor = module.dequantize_tensor(q, scale, zero_point, spec, dtype, shape)
    return out
