"""GPTQ as a calibrated method: the policy (what it collects in which pass, what it keeps); the
solve itself is numerics/gptq.py.

Pass 1 of each block (engine/calibrate/sequential.py) runs the block on three streams of
activations, the calibration windows it fits (`fit`), the ones held out (`held`) and the check
text (`check`), and a HessianProbe gathers each stream's Hessian of every target Linear's
inputs. Then, per Linear: GPTQ's codes from the `fit` Hessian, round to nearest on the same grid,
the guard (engine/methods/guard.py) comparing the two on `held` and `check`, and the chosen
codes into the Spill, measured against the ORIGINAL weights; the chosen weights (as a consumer
dequantizes them) replace the block's, so that pass 2 propagates the quantized outputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from qtool.calibration import Calibration, Guard
from qtool.engine.calibrate.blocks import return_freed_memory
from qtool.engine.calibrate.sequential import Enough
from qtool.engine.methods.guard import change, describe, judge, rounded
from qtool.engine.model.hooks import Hooks
from qtool.engine.spill import Spill
from qtool.numerics import gptq, kernels
from qtool.numerics.metrics import error_stats
from qtool.spec import QSpec

STREAMS = ("fit", "held", "check")
METHOD = "gptq"


@dataclass(frozen=True)
class Target:
    """A Linear weight the plan quantizes: its spec (fitted to its shape) and stored dtype."""

    spec: QSpec
    dtype: torch.dtype


@dataclass(frozen=True)
class Chosen:
    """What a Linear got: `method` (gptq or rtn) and the table's note saying why."""

    method: str
    note: str


class HessianProbe(Hooks):
    """Forward pre-hooks on `linears` (module name -> Linear): the Hessian of each one's inputs
    on the stream now running (`stream`), per stream.

    Linears called one after the other on the same input tensor (q/k/v, gate/up in the Llama
    family) share one Hessian: a Linear whose first input is the object the Linear hooked just
    before it received is that one's sharer from then on (its rows are not added again), and
    each later call checks that it still is (RuntimeError otherwise: a model that feeds them
    different inputs after all).

    Given the `block`, a window whose Linears were called in the order the first whole window
    called them, each once, stops at the last one's hook (Enough: pass 1 drops the block's
    outputs, so the rest of its forward is not run). A Llama-family block calls each of its
    Linears once per forward in one order; a window that does not is run to its end."""

    share = True  # tests compare with each Linear's own

    def __init__(
        self, linears: dict[str, torch.nn.Linear], block: torch.nn.Module | None = None
    ) -> None:
        self.linears = linears
        self.block = block
        self.stream = STREAMS[0]
        self.hessians: dict[tuple[str, str], gptq.Hessian] = {}
        self.owner: dict[str, str] = {}  # Linear -> the Linear whose Hessian it uses
        self._last: tuple[Any, str] | None = None  # the input last added, and whose
        self._taken: dict[tuple[str, str], int] = {}
        self._calls: list[str] = []  # this window's Linears so far
        self._window: list[str] | None = None  # a whole window's, in order

    def _attach(self) -> list[Any]:
        hooks = [m.register_forward_pre_hook(self._hook(n)) for n, m in self.linears.items()]
        if self.block is not None:
            hooks.append(self.block.register_forward_hook(self._whole))
        return hooks

    def _whole(self, module: Any, args: Any, output: Any) -> None:
        """A window ran to the block's end: the first to call every Linear once sets the
        order later windows stop after."""
        calls, self._calls = self._calls, []
        if self._window is None and len(set(calls)) == len(calls) == len(self.linears):
            self._window = calls

    def _called(self, name: str) -> None:
        self._calls.append(name)
        if self._window is not None and self._calls == self._window:
            self._calls = []
            raise Enough

    def _hook(self, name: str) -> Callable[[Any, tuple[Any, ...]], None]:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            last = self._last
            same = last is not None and last[0] is args[0]
            if name not in self.owner:
                self.owner[name] = last[1] if same and self.share and last else name
            owner = self.owner[name]
            if owner != name:
                if not (same and last is not None and last[1] == owner):
                    raise RuntimeError(f"{name} shares the Hessian of {owner} but was called on "
                                       "another input")  # fmt: skip
                self._called(name)
                return
            x = args[0].detach()
            key = (name, self.stream)
            if key not in self.hessians:
                self.hessians[key] = gptq.Hessian(x.shape[-1], device=x.device)
            self.hessians[key].add(x.reshape(-1, x.shape[-1]))
            self._last = (args[0], name)
            self._called(name)

        return hook

    def matrix(self, name: str, stream: str) -> torch.Tensor | None:
        found = self.hessians.get((self.owner.get(name, name), stream))
        return found.matrix if found is not None and found.rows else None

    def take(self, name: str, stream: str) -> torch.Tensor | None:
        """matrix(), the probe letting go of that Hessian once every Linear sharing it took it
        (a Linear's three are alive only until it and its sharers are solved)."""
        found = self.matrix(name, stream)
        owner = self.owner.get(name, name)
        key = (owner, stream)
        self._taken[key] = self._taken.get(key, 0) + 1
        if self._taken[key] >= sum(o == owner for o in self.owner.values()):
            self.hessians.pop(key, None)
            self._last = None  # the input it holds is spent too
        return found


class GptqPolicy:
    """GPTQ over a run's `targets` (checkpoint name -> Target): results into `spill`, what each
    Linear got into `chosen`. `scales_in_weight_dtype`: the format stores scales in the
    weight's dtype (compressed-tensors), so codes are chosen against them rounded so."""

    streams = STREAMS

    def __init__(
        self,
        targets: dict[str, Target],
        calibration: Calibration,
        spill: Spill,
        scales_in_weight_dtype: bool,
    ) -> None:
        self.targets, self.calibration, self.spill = targets, calibration, spill
        self.scales_in_weight_dtype = scales_in_weight_dtype
        self.chosen: dict[str, Chosen] = {}
        # the block's round-to-nearest reconstructions (the guard's baseline), by weight name:
        # the model KL's rounding stream takes them (verdict.ModelStreams), one block's at a time
        self.rounded: dict[str, torch.Tensor] = {}
        self._rtn: torch.Tensor | None = None  # the last _choose's

    def probe(self, block: torch.nn.Module, prefix: str) -> HessianProbe:
        """Pass 1's hooks: on the block's Linears the plan quantizes (an integer grid)."""
        linears = {
            name: m for name, m in block.named_modules()
            if isinstance(m, torch.nn.Linear) and f"{prefix}{name}.weight" in self.targets
        }  # fmt: skip
        return HessianProbe(linears, block)

    def quantize(self, prefix: str, probe: HessianProbe) -> None:
        """Each probed Linear's codes chosen and spilled; its weight replaced by the chosen
        reconstruction (what the next blocks see)."""
        self.rounded.clear()  # the last block's, if nothing took them
        for local, linear in probe.linears.items():
            name = f"{prefix}{local}.weight"
            hessians = {stream: probe.take(local, stream) for stream in STREAMS}
            if hessians["fit"] is None:  # never called on the calibration windows: left to the loop
                continue
            target = self.targets[name]
            result, weight, chosen = self._choose(linear.weight.detach(), target, hessians)
            del hessians  # the next Linear's solve has their memory
            self.spill.put(name, target.spec, result)
            linear.weight.data.copy_(weight)
            self.chosen[name] = chosen
            if self._rtn is not None:  # held as stored until the rounding stream widens it
                self.rounded[name], self._rtn = self._rtn.to(target.dtype), None
            del result, weight
            return_freed_memory()  # one Linear's solve resident at a time, not the block's

    def _choose(
        self, weight: torch.Tensor, target: Target, hessians: dict[str, torch.Tensor | None]
    ) -> tuple[kernels.QuantizedTensor, torch.Tensor, Chosen]:
        """`hessians` by stream; the fit one is handed over to the solve, which lets it go once
        factorised (the column loop and the guard run without it)."""
        held, check = hessians["held"], hessians["check"]
        spec, dtype = target.spec, target.dtype
        scale_dtype = dtype if self.scales_in_weight_dtype else torch.float32
        original = weight.to(dtype)  # the stored values (float32 holds them exactly)
        rtn = kernels.quantize_with(original, spec, scale_dtype=scale_dtype)
        rtn_weight = restored(rtn, spec, dtype, tuple(weight.shape))
        self._rtn = rtn_weight
        why = gptq.unsupported(spec)
        if why is None and held is None and self.calibration.guard is not Guard.NONE:
            # the fit rows' Hessian would judge GPTQ on what it was fitted to (it always wins)
            why = "no held-out window reached this Linear, so no verdict"
        if why is not None:
            return rtn, rtn_weight, Chosen("rtn", rounded(METHOD, why))
        solved = gptq.gptq_quantize(
            weight.float(), cast(torch.Tensor, hessians.pop("fit")), spec, scale_dtype=scale_dtype,
            dynamic_groups=self.calibration.dynamic_groups,
        )  # fmt: skip
        if solved.fallback is not None:
            return rtn, rtn_weight, Chosen("rtn", rounded(METHOD, solved.fallback.value))
        result = solved.quantized(spec)
        g_weight = restored(result, spec, dtype, tuple(weight.shape))
        errors = error_stats(original, g_weight)
        result = kernels.QuantizedTensor(
            result.q, result.scale, result.zero_point, errors, method=METHOD
        )
        verdict = judge(
            output_change(g_weight - weight, rtn_weight - weight, held),
            output_change(g_weight - weight, rtn_weight - weight, check),
            self.calibration.guard,
            self.calibration.tolerance,
        )
        note = describe(METHOD, verdict)
        if verdict.keep:
            return result, g_weight, Chosen(METHOD, note)
        return rtn, rtn_weight, Chosen("rtn", note)


def output_change(
    delta: torch.Tensor, baseline: torch.Tensor, hessian: torch.Tensor | None
) -> float | None:
    if hessian is None:  # no row of that stream reached the Linear: nothing to compare
        return None
    return change(gptq.output_error(delta, hessian), gptq.output_error(baseline, hessian))


def restored(
    result: kernels.QuantizedTensor, spec: QSpec, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """The weight as a consumer reconstructs it (dequantized, in its dtype), as float32."""
    return kernels.dequantize(
        result.q, result.scale, result.zero_point, spec, dtype=dtype, shape=shape
    ).float()
