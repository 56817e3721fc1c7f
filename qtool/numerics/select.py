"""Which kernels quantize and dequantize a tensor: the torch reference or the fused CPU kernels.

QTOOL_KERNEL (environment) chooses: `auto` (default), `torch`, or `fused`.
- auto: the fused kernels for CPU tensors when numba is installed and the run's work pays for
  loading them (LOAD_SECONDS: import numba, the kernels' cached machine code, the first call).
  The work is estimated per tensor from its elements, input dtype and spec (COSTS: the mse
  search costs tens of times min-max; groups and 16-bit inputs more than rows of fp32), on the
  figures of a quiet machine, which favour the torch kernels; then it is measured: every torch
  call is timed, and once the time the rest of the run would save under the load seen so far
  passes LOAD_SECONDS, the fused kernels are loaded between two calls and take over. Both paths
  give the same bits, so the choice shows nowhere but in the time. A numba that fails to load
  leaves the torch kernels.
- torch: always the torch kernels (the reference, and the only CUDA path).
- fused: the fused kernels for every CPU tensor they cover; without numba a usage error naming
  the extra to install.
Whatever is chosen, CUDA tensors, 0-d tensors, the mse search per tensor or per channel on
an axis other than 0, and the mse search weighted by an importance matrix run the torch kernels.
Where numba is missing and the torch kernels took much longer than the fused ones would have,
`notes()` says so (once per run).
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

import torch

from qtool.errors import UsageError
from qtool.spec import PerChannel, PerGroup, QSpec, RangeMethod, matrix_shape

ENV = "QTOOL_KERNEL"
INSTALL_HINT = "pip install 'qtool[fast]'"
LOAD_SECONDS = 1.0  # numba's import and first call, cache warm: 0.7-1.1 s (docs/performance.md)
# (torch, fused) nanoseconds per element on 2 threads of a quiet machine, with error sums and
# everything around the kernels in a run (min-max: 1.25 and 0.25 s per GiB of fp32 in process,
# docs/performance.md; groups and the mse search scaled by their kernel-only ratios). Under load
# the torch kernels slow down many times more than the fused ones: the measurement below
# catches that.
COSTS = {
    "minmax": (4.7, 0.9),
    "groups": (6.0, 1.8),
    "mse": (60.0, 4.0),
    "restore": (0.8, 0.25),  # dequantize, per byte of input
    "compare": (15.0, 4.0),  # compare's error figures, per element of a pair (1 thread, load 12)
}
WIDE_INPUT = 1.3  # bf16/fp16 cost the torch kernels an exact upcast pass more
MIN_MEASURED = 0.1  # seconds of torch calls before their speed is trusted,
MIN_PREDICTED = 0.01  # and quiet seconds of work in them (tiny calls are all fixed costs)
HINT_SECONDS = 5.0  # a run that would have saved this much says so when numba is missing
# a restore (dequantize) of this many bytes pays for loading numba
AUTO_MIN_BYTES = math.ceil(LOAD_SECONDS / ((COSTS["restore"][0] - COSTS["restore"][1]) * 1e-9))


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


@dataclass(frozen=True)
class Work:
    """One tensor a run will quantize: what decides the kernels' time on it."""

    shape: tuple[int, ...]
    wide: bool  # a 16-bit input (bf16/fp16)
    spec: QSpec


def work_class(spec: QSpec, shape: tuple[int, ...]) -> str | None:
    """The COSTS entry of quantizing a tensor of `shape` with `spec`; None where the fused
    kernels do not take it (0-d; the mse search per tensor or on another axis)."""
    g = spec.granularity
    rows = isinstance(g, PerGroup) or (isinstance(g, PerChannel) and g.axis == 0)
    if not shape or (spec.range_method is RangeMethod.MSE and not (rows and len(shape) >= 2)):
        return None
    if spec.range_method is RangeMethod.MSE:
        return "mse"
    return "groups" if isinstance(g, PerGroup) and g.size < matrix_shape(shape)[1] else "minmax"


class _Meter:
    """The run's work left (in seconds the torch kernels would take on a quiet machine, and
    what the fused kernels would save of them), and the torch calls measured so far."""

    def __init__(self) -> None:
        self.reset(0.0, 0.0)

    def reset(self, torch_seconds: float, saving: float) -> None:
        self.left, self.saving = torch_seconds, saving
        self.measured = self.predicted = self.predicted_saving = 0.0
        self.hinted = False

    @property
    def slowdown(self) -> float:
        """Measured over quiet torch time (1 until enough was measured to tell)."""
        if self.measured < MIN_MEASURED or self.predicted < MIN_PREDICTED:
            return 1.0
        return self.measured / self.predicted

    def projected_saving(self) -> float:
        """Seconds the fused kernels would save on the rest of the run, at the load seen."""
        return self.saving * self.slowdown

    def saved_so_far(self) -> float:
        """Seconds the fused kernels would have saved on the torch calls measured."""
        return self.predicted_saving * self.slowdown

    def took(self, predicted: float, saving: float, seconds: float) -> None:
        if not predicted:  # work the fused kernels would not take: no measure of either
            return
        self.left = max(0.0, self.left - predicted)
        self.saving = max(0.0, self.saving - saving)
        self.measured += seconds
        self.predicted += predicted
        self.predicted_saving += saving


_METER = _Meter()


def _estimate(work: Iterable[Work]) -> tuple[float, float]:
    """(quiet torch seconds, seconds the fused kernels save of them) of the work they cover."""
    torch_s = saved = 0.0
    for w in work:
        t, f = _cost(w.spec, w.shape, math.prod(w.shape), w.wide)
        torch_s, saved = torch_s + t, saved + f
    return torch_s, saved


def _cost(spec: QSpec, shape: tuple[int, ...], numel: int, wide: bool) -> tuple[float, float]:
    """(quiet torch seconds, fused saving) of one tensor; (0, 0) where fused does not apply."""
    kind = work_class(spec, shape)
    if kind is None:
        return 0.0, 0.0
    slow, fast = COSTS[kind]
    slow *= WIDE_INPUT if wide else 1.0
    return numel * slow * 1e-9, numel * (slow - fast) * 1e-9


def expect(device: torch.device, nbytes: int, kind: str = "restore") -> None:
    """Told at the start of a run how many bytes of tensors it will restore (dequantize) on
    `device` (kind "compare": how many elements it will measure): checks QTOOL_KERNEL, and
    loads the fused kernels when they will be used."""
    slow, fast = COSTS[kind]
    _expect(device, nbytes * slow * 1e-9, nbytes * (slow - fast) * 1e-9)


def expect_work(device: torch.device, work: Iterable[Work]) -> None:
    """Told at the start of a run what it will quantize on `device` (see the module doc)."""
    _expect(device, *_estimate(work))


def _expect(device: torch.device, torch_seconds: float, saved: float) -> None:
    kernel = requested()
    _METER.reset(torch_seconds, saved)
    if device.type != "cpu" or kernel is Kernel.TORCH:
        return
    if kernel is Kernel.FUSED:
        _LOADER.now()
    elif saved >= LOAD_SECONDS and numba_installed():
        _LOADER.load()


def _measured(cost: tuple[float, float], started: float) -> None:
    """A torch call of `cost` (quiet seconds, fused saving) took since `started`: in auto, load
    the fused kernels once the rest of the run would pay for them at the speed seen."""
    _METER.took(*cost, time.perf_counter() - started)
    if _LOADER.tried or _METER.projected_saving() < LOAD_SECONDS:
        return
    if numba_installed():
        _LOADER.load()


def notes() -> list[str]:
    """What a run has to say about the kernels (once): that the fused kernels, which numba
    (missing or broken) would have run, would have saved much of the torch kernels' time."""
    if _METER.hinted or _LOADER.module is not None or requested() is not Kernel.AUTO:
        return []
    saved = _METER.saved_so_far()
    if saved - LOAD_SECONDS < HINT_SECONDS:
        return []
    _METER.hinted = True
    broken = _LOADER.error is not None and not isinstance(_LOADER.error, ImportError)
    why = f"numba did not load: {_why(_LOADER.error)}" if broken else (
        f"numba is not installed ({INSTALL_HINT})")  # fmt: skip
    return [
        f"the torch kernels took {_METER.measured:.0f} s of this run; the fused kernels would "
        f"have taken about {saved:.0f} s less, but {why}"
    ]


def fused_loaded(device: torch.device) -> bool:
    """Whether the fused kernels take this run's work on `device`: asked for (QTOOL_KERNEL=fused:
    loaded now, or the usage error), or loaded because expect() found the run worth it."""
    kernel = requested()
    if kernel is Kernel.TORCH or device.type != "cpu":
        return False
    return _LOADER.now() is not None if kernel is Kernel.FUSED else _LOADER.module is not None


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


def fused_for(x: torch.Tensor, spec: QSpec, *, weighted: bool = False) -> ModuleType | None:
    """The fused module when it should quantize `x` with `spec`, else None (the torch kernels);
    a `weighted` mse search (an importance matrix's weights) runs the torch kernels, which alone
    take weights."""
    if weighted and spec.range_method is RangeMethod.MSE:
        return None
    return _fused_for(x.device, x.ndim, spec)


def measured(x: torch.Tensor, spec: QSpec, started: float) -> None:
    """The torch kernels quantized `x` with `spec` since `started` (time.perf_counter): in auto
    on the CPU, the call counts towards loading the fused kernels (see the module doc)."""
    if x.device.type == "cpu" and requested() is Kernel.AUTO:
        wide = x.dtype in (torch.bfloat16, torch.float16)
        _measured(_cost(spec, tuple(x.shape), x.numel(), wide), started)


def restorer_for(device: torch.device, ndim: int, spec: QSpec) -> ModuleType | None:
    """The fused module when it should dequantize a tensor of `ndim` dims with `spec` on
    `device`, else None (the torch kernels)."""
    return _fused_for(device, ndim, spec)


def restore_measured(q: torch.Tensor, shape: tuple[int, ...], started: float) -> None:
    """The torch kernels dequantized the codes `q` of a tensor of `shape` since `started`: in
    auto on the CPU, the call counts towards loading the fused kernels."""
    if q.device.type == "cpu" and requested() is Kernel.AUTO and shape:
        slow, fast = COSTS["restore"]
        _measured((q.numel() * slow * 1e-9, q.numel() * (slow - fast) * 1e-9), started)
