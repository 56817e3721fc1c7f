"""Which kernels quantize and dequantize a tensor: the torch reference or the fused CPU kernels.

QTOOL_KERNEL (environment) chooses: `auto` (default), `torch`, or `fused`.
- auto: the fused kernels for CPU tensors when numba is installed and the run is big enough to
  pay for loading them (`expect`: AUTO_MIN_BYTES of tensors to quantize or restore; loading is
  import numba plus its cached machine code, 0.7-1.1 s). Both paths give the same bits, so the
  choice shows nowhere but in the time. A numba that fails to load leaves the torch kernels.
- torch: always the torch kernels (the reference, and the only CUDA path).
- fused: the fused kernels for every CPU tensor they cover; without numba a usage error naming
  the extra to install.
Whatever is chosen, CUDA tensors, 0-d tensors and the mse search per tensor or per channel on
an axis other than 0 run the torch kernels.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import os
from types import ModuleType

import torch

from qtool.errors import UsageError
from qtool.numerics import kernels
from qtool.numerics.kernels import QuantizedTensor, Workspace
from qtool.spec import QSpec

ENV = "QTOOL_KERNEL"
AUTO_MIN_BYTES = 512 << 20  # break-even of loading numba: 0.1-0.7 GiB (docs/performance.md)
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
    """Imports the fused kernels at most once per process (numba's import and its first call
    cost the same whatever the tensor: paid once, and only when a run asks for it)."""

    def __init__(self) -> None:
        self.module: ModuleType | None = None
        self.error: BaseException | None = None
        self.tried = False

    def load(self) -> ModuleType | None:
        """The fused module, loaded and warmed here on the first call; None when it failed."""
        if not self.tried:
            self.tried = True
            try:
                module = importlib.import_module("qtool.numerics.fused")
                module.warm_up()
                self.module = module
            except Exception as err:  # a broken numba leaves the torch kernels in charge
                self.error = err
        return self.module

    def now(self) -> ModuleType:
        """The fused module, or the usage error that says why it cannot be had."""
        module = self.load()
        if module is None:
            raise UsageError(None, f"{ENV}=fused: {_why(self.error)}, or unset {ENV}")
        return module


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
    `device`: checks QTOOL_KERNEL, and loads the fused kernels when they will be used."""
    kernel = requested()
    if device.type != "cpu" or kernel is Kernel.TORCH:
        return
    if kernel is Kernel.FUSED:
        _LOADER.now()
    elif nbytes >= AUTO_MIN_BYTES and numba_installed():
        _LOADER.load()


def _fused_for(device: torch.device, ndim: int, spec: QSpec) -> ModuleType | None:
    """The fused module when it should take this tensor, else None (torch kernels)."""
    kernel = requested()
    if kernel is Kernel.TORCH or device.type != "cpu" or ndim == 0:
        return None
    module = _LOADER.now() if kernel is Kernel.FUSED else _LOADER.module
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
    module = _fused_for(x.device, x.ndim, spec)
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
    module = _fused_for(q.device, len(shape), spec)
    if module is None:
        return kernels.dequantize(q, scale, zero_point, spec, dtype, shape=shape)
    out: torch.Tensor = module.dequantize_tensor(q, scale, zero_point, spec, dtype, shape)
    return out
