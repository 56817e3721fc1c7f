"""AWQ as a calibrated method: per decoder block, per balanced group (a norm or Linear before,
the Linears sharing its output as input), scales searched on the block's output error on the
fit windows (numerics/awq.py), kept only where the guard says they help, folded into the module
before; then every Linear the plan quantizes is rounded to nearest from its (scaled) weight.

Pass 1 (engine/calibrate/sequential.py) runs the float block on the three streams (`fit`,
`held`, `check`): the probe keeps each group's E|x| on the fit windows, a reference to each
window's block input and a copy of the float block's output. Each group's candidates are judged
by the block's output with the group's Linears as Q(W diag(s)) diag(s)^-1 (the folded model's
effective weights) and the block's other Linears as they stand (float, earlier groups' folds
applied), as llm-compressor's AWQModifier judges them. The guard compares the chosen scales
with s = 1 (round to nearest of the same Linears) by that block output error on the held-out
windows and the check text: a real forward pass, so it sees the fold into the module before
(which changes another Linear's codes) and everything between the Linears and the block's
output, where the Hessian of one Linear's inputs would not. A folded float tensor that the plan
keeps float (a norm; the bias or weight of a Linear before that the plan does not quantize)
waits in the Spill and is written instead of the input's bytes, rounded to its stored dtype,
and the block goes on with those rounded values."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qtool.calibration import Calibration
from qtool.engine.hooks import Hooks
from qtool.engine.methods.gptq import STREAMS, Chosen, Target, restored
from qtool.engine.methods.guard import change, describe, judge
from qtool.engine.spill import Spill
from qtool.numerics import awq, kernels
from qtool.numerics.metrics import error_stats
from qtool.numerics.quantize import quantize_tensor

METHOD = "awq"

LLAMA_GROUPS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)
"""llm-compressor's mappings for the Llama family, in its order (module before, Linears)."""


@dataclass(frozen=True)
class Group:
    """A balanced group of a block (local module names): `previous`'s output is the input of
    every Linear in `linears`."""

    previous: str
    linears: tuple[str, ...]


def groups(block: torch.nn.Module) -> list[Group]:
    """The block's balanced groups, from its modules: each of LLAMA_GROUPS whose modules exist
    and whose widths agree (v -> o only where v_proj's outputs are o_proj's inputs, i.e. without
    grouped-query attention, as llm-compressor skips it)."""
    modules = dict(block.named_modules())
    found = []
    for previous, names in LLAMA_GROUPS:
        before = modules.get(previous)
        linears = [modules.get(n) for n in names]
        if before is None or not all(isinstance(m, torch.nn.Linear) for m in linears):
            continue
        width = {m.in_features for m in linears if isinstance(m, torch.nn.Linear)}
        if isinstance(before, torch.nn.Linear):
            out = before.out_features
        else:
            weight = getattr(before, "weight", None)
            out = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.ndim == 1 else -1
        if width == {out}:
            found.append(Group(previous, names))
    return found


@torch.no_grad()
def fold(block: torch.nn.Module, group: Group, scales: torch.Tensor) -> None:
    """The block computes the same function with the group's Linears' input columns scaled by
    s and s divided out of the module before (numerics/awq); ValueError from a norm that does
    not scale with its weight (left as it was)."""
    modules = dict(block.named_modules())
    before = modules[group.previous]
    if isinstance(before, torch.nn.Linear):
        awq.fold_into_linear(before, scales)
    else:
        awq.fold_into_norm(before, scales)
    awq.scale_inputs([modules[n] for n in group.linears], scales)


class AwqProbe(Hooks):
    """Pass 1's hooks: the block's inputs (references: the pass replaces them only in pass 2)
    and keyword arguments, a copy of its float outputs into `outputs` (one tensor per window,
    in pass order), and E|x| of each group's inputs on the fit windows."""

    def __init__(
        self, block: torch.nn.Module, groups: list[Group], outputs: list[torch.Tensor]
    ) -> None:
        self.block, self.groups, self.outputs = block, groups, outputs
        self.stream = STREAMS[0]
        self.inputs: dict[str, list[torch.Tensor]] = {s: [] for s in STREAMS}
        self.kwargs: dict[str, Any] = {}
        self.means: dict[str, awq.AbsMean] = {}
        self.done = 0  # windows whose outputs are kept

    def _attach(self) -> list[Any]:
        modules = dict(self.block.named_modules())
        handles = [
            self.block.register_forward_pre_hook(self._input, with_kwargs=True),
            self.block.register_forward_hook(self._output),
        ]
        for g in self.groups:
            handles.append(modules[g.linears[0]].register_forward_pre_hook(self._mean(g)))
        return handles

    def _input(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.inputs[self.stream].append(args[0])
        self.kwargs = kwargs

    def _output(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        y = output[0] if isinstance(output, tuple) else output
        self.outputs[self.done].copy_(y.detach())
        self.done += 1

    def _mean(self, group: Group) -> Callable[[Any, tuple[Any, ...]], None]:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            if self.stream != "fit":
                return
            x = args[0].detach()
            if group.previous not in self.means:
                self.means[group.previous] = awq.AbsMean(x.shape[-1], device=x.device)
            self.means[group.previous].add(x)

        return hook

    def error(self, stream: str) -> float:
        """The block's output error (sum of squares against the float outputs) on `stream`."""
        start = sum(len(self.inputs[s]) for s in STREAMS[: STREAMS.index(stream)])
        total = 0.0
        for k, x in enumerate(self.inputs[stream]):
            y = self.block(x, **self.kwargs)
            y = y[0] if isinstance(y, tuple) else y
            total += float((y.float() - self.outputs[start + k]).square().sum(dtype=torch.float64))
        return total


class AwqPolicy:
    """AWQ over a run's `targets` (checkpoint name -> Target) and the tensors the plan keeps
    float (`kept`: name -> stored dtype, the ones a fold may change); codes and changed float
    tensors into `spill`, what each Linear got into `chosen`. `outputs`: one buffer per window
    of every stream, (1, ctx, hidden) float32, where the float block's outputs are kept."""

    streams = STREAMS

    def __init__(
        self,
        targets: dict[str, Target],
        kept: dict[str, torch.dtype],
        calibration: Calibration,
        spill: Spill,
        scales_in_weight_dtype: bool,
        outputs: list[torch.Tensor],
    ) -> None:
        self.targets, self.kept, self.calibration, self.spill = targets, kept, calibration, spill
        self.scales_in_weight_dtype = scales_in_weight_dtype
        self.outputs = outputs
        self.chosen: dict[str, Chosen] = {}
        self.changed: dict[str, str] = {}  # kept float tensor -> the table's note

    def probe(self, block: torch.nn.Module, prefix: str) -> AwqProbe:
        return AwqProbe(block, groups(block), self.outputs)

    def quantize(self, prefix: str, probe: AwqProbe) -> None:
        """Each group searched, judged and folded in order; then every target Linear of the
        block rounded to nearest from its weight as it stands, its codes spilled and its weight
        replaced by what a consumer reconstructs (what pass 2 propagates)."""
        block = probe.block
        modules = dict(block.named_modules())
        notes: dict[str, str] = {}
        scaled: set[str] = set()
        for group in probe.groups:
            why = self._unbalanced(prefix, group, modules, probe)
            if why is not None:
                for n in group.linears:
                    notes.setdefault(n, f"rtn ({METHOD}: {why})")
                continue
            note, changed = self._balance(prefix, group, modules, probe)
            for n in group.linears:
                notes[n] = note
            if group.previous in changed:  # its output rows carry the next group's scales
                rows = f"output rows scaled by {METHOD} for {', '.join(group.linears)}"
                notes[group.previous] = f"{notes.get(group.previous, METHOD)}; {rows}"
            scaled |= changed
        for local, linear in modules.items():
            name = f"{prefix}{local}.weight"
            if not isinstance(linear, torch.nn.Linear) or name not in self.targets:
                continue
            method = METHOD if local in scaled else "rtn"
            note = notes.get(local, f"rtn ({METHOD}: in no balanced group)")
            self._round(name, linear, method)
            self.chosen[name] = Chosen(method, note)

    def _unbalanced(
        self, prefix: str, group: Group, modules: dict[str, Any], probe: AwqProbe
    ) -> str | None:
        """Why the group cannot be balanced in this run (None: it can)."""
        specs = {self.targets.get(f"{prefix}{n}.weight") for n in group.linears}
        if None in specs:
            return "a Linear of its group is not quantized"
        if len({t.spec for t in specs if t is not None}) > 1:
            return "its group's Linears have different specs"
        if group.previous not in probe.means:
            return "no calibration input"
        before = modules[group.previous]
        for name in self._folded(prefix, group, modules):
            codes = isinstance(before, torch.nn.Linear) and name.endswith(".weight")
            if name not in self.kept and not (codes and name in self.targets):
                return f"{name} is quantized otherwise"  # its folded values would be lost
        return None

    def _folded(self, prefix: str, group: Group, modules: dict[str, Any]) -> list[str]:
        """The checkpoint names of the tensors a fold into `group.previous` changes."""
        before = modules[group.previous]
        names = [f"{prefix}{group.previous}.weight"]
        if getattr(before, "bias", None) is not None:
            names.append(f"{prefix}{group.previous}.bias")
        return names

    def _balance(
        self, prefix: str, group: Group, modules: dict[str, Any], probe: AwqProbe
    ) -> tuple[str, set[str]]:
        """Search the group's scales, judge them, fold them where kept: (note, the local names of
        the Linears whose weights changed)."""
        linears = [modules[n] for n in group.linears]
        target = self.targets[f"{prefix}{group.linears[0]}.weight"]
        spec, scale_dtype = target.spec, self._scale_dtype(target)
        originals = [m.weight.detach().clone() for m in linears]

        def error(stream: str, s: torch.Tensor) -> float:
            for m, w in zip(linears, originals, strict=True):
                m.weight.copy_(awq.quantized_scaled(w, s, spec, scale_dtype))
            try:
                return probe.error(stream)
            finally:
                for m, w in zip(linears, originals, strict=True):
                    m.weight.copy_(w)

        x_mean = probe.means[group.previous].mean
        try:
            w_mean = awq.weight_means(originals, spec)
        except ValueError as err:  # a grid across output rows (channels on axis 1)
            return f"rtn ({METHOD}: {err})", set()
        try:
            choice = awq.search(lambda s: error("fit", s), x_mean, w_mean)
        except awq.NonFiniteLoss:
            return f"rtn ({METHOD}: every candidate's output error was NaN or infinite)", set()
        ones = torch.ones_like(choice.scales)
        if torch.equal(choice.scales, ones):  # the identity won on the fit windows
            return f"rtn ({METHOD}: round to nearest had the least output error)", set()
        held = change(error("held", choice.scales), error("held", ones))
        check = change(error("check", choice.scales), error("check", ones))
        verdict = judge(held, check, self.calibration.guard, self.calibration.tolerance)
        if not verdict.keep:
            return describe(METHOD, verdict), set()
        fold(probe.block, group, choice.scales)
        changed = set(group.linears)
        before = modules[group.previous]
        if isinstance(before, torch.nn.Linear) and f"{prefix}{group.previous}.weight" in (
            self.targets
        ):
            changed.add(group.previous)
        for name in self._folded(prefix, group, modules):
            if name in self.kept:
                self._keep(name, before, name.rsplit(".", 1)[1])
        return describe(METHOD, verdict), changed

    def _keep(self, name: str, module: torch.nn.Module, attribute: str) -> None:
        """A folded float tensor the plan keeps: rounded to its stored dtype, in the block and
        in the Spill (the writer stores it instead of the input's bytes)."""
        p = getattr(module, attribute)
        stored = p.detach().to(self.kept[name])
        p.data.copy_(stored.float())
        self.spill.put_float(name, stored)
        self.changed[name] = f"scaled by {METHOD}"

    def _round(self, name: str, linear: torch.nn.Linear, method: str) -> None:
        """Round to nearest from the weight as it stands: a scaled one's codes into the Spill;
        an unchanged one's are the loop's own (left to it). Either way the block goes on with
        what a consumer reconstructs."""
        target = self.targets[name]
        weight = linear.weight.detach().float()
        scaled = method == METHOD
        source = weight if scaled else weight.to(target.dtype)  # the loop reads the stored one
        result = quantize_tensor(source, target.spec, scale_dtype=self._scale_dtype(target))
        reconstruction = restored(result, target.spec, target.dtype, tuple(weight.shape))
        if scaled:
            errors = error_stats(weight, reconstruction)
            result = kernels.QuantizedTensor(
                result.q, result.scale, result.zero_point, errors, method=METHOD
            )
            self.spill.put(name, target.spec, result)
        linear.weight.data.copy_(reconstruction)

    def _scale_dtype(self, target: Target) -> torch.dtype:
        return target.dtype if self.scales_in_weight_dtype else torch.float32


def output_buffers(
    windows: int, ctx: int, width: int, device: torch.device, mapped: Sequence[torch.Tensor] | None
) -> list[torch.Tensor]:
    """One (1, ctx, width) float32 buffer per window: `mapped` (sequential.spilled's file, past
    its bound) or new tensors on `device`."""
    if mapped is not None:
        return list(mapped)
    return [torch.empty(1, ctx, width, device=device) for _ in range(windows)]
