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

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from qtool.calibration import Calibration, Guard
from qtool.engine.methods import replay
from qtool.engine.methods.gptq import STREAMS, Chosen, HessianProbe, Target, output_change, restored
from qtool.engine.methods.guard import change, describe, describe_figures, judge, rounded
from qtool.engine.model.hooks import Hooks
from qtool.engine.spill import Spill
from qtool.numerics import awq, gptq, kernels
from qtool.numerics.metrics import error_stats

METHOD = "awq"
THEN_GPTQ = "awq+gptq"

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
        self.ran: dict[str, replay.Ran] | None = None  # the order the block's modules run in
        self.recorded: dict[tuple[str, Group], replay.Recorded] = {}

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

    def error(self, stream: str, group: Group | None = None) -> float:
        """The block's output error (sum of squares against the float outputs) on `stream`;
        with the `group` whose Linears alone change between calls, the modules before them are
        replayed from the first call's outputs (engine/methods/replay.py: the same bits)."""
        start = sum(len(self.inputs[s]) for s in STREAMS[: STREAMS.index(stream)])
        total = 0.0
        for k, x in enumerate(self.inputs[stream]):
            with self._forward(stream, group, k):
                y = self.block(x, **self.kwargs)
            y = y[0] if isinstance(y, tuple) else y
            total += float((y.float() - self.outputs[start + k]).square().sum(dtype=torch.float64))
        return total

    @contextmanager
    def _forward(self, stream: str, group: Group | None, window: int) -> Iterator[None]:
        """The context of one window's forward: replaying or recording `group`'s fixed modules,
        or, on the first forward of all, learning the order the block's modules run in."""
        if group is None:
            yield
            return
        if self.ran is None:
            ran: dict[str, replay.Ran] = {}
            with replay.execution(self.block, ran):
                yield
            self.ran = ran
            return
        key = (stream, group)
        if key not in self.recorded:
            windows = len(self.inputs[stream])
            names = replay.fixed_modules(self.block, self.ran, group.linears, windows)
            self.recorded[key] = replay.Recorded(self.block, names)
        recorded = self.recorded[key]
        with recorded.replaying(window) if recorded.has(window) else recorded.record(window):
            yield

    def forget(self, group: Group) -> None:
        """Drop `group`'s records (a fold changes the modules before its Linears)."""
        for key in [k for k in self.recorded if k[1] == group]:
            del self.recorded[key]


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
        then_gptq: bool = False,
    ) -> None:
        self.targets, self.kept, self.calibration, self.spill = targets, kept, calibration, spill
        self.scales_in_weight_dtype = scales_in_weight_dtype
        self.outputs = outputs
        self.then_gptq = then_gptq  # GPTQ's codes of the smoothed weights (awq+gptq)
        self.chosen: dict[str, Chosen] = {}
        self.changed: dict[str, str] = {}  # kept float tensor -> the table's note
        # this block's folds, local Linear name -> scales: of its input columns, of its rows
        self.columns: dict[str, torch.Tensor] = {}
        self.rows: dict[str, torch.Tensor] = {}

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
        self.columns, self.rows = {}, {}
        targets = {
            local: m for local, m in modules.items()
            if isinstance(m, torch.nn.Linear) and f"{prefix}{local}.weight" in self.targets
        }  # fmt: skip
        originals = {n: m.weight.detach().clone() for n, m in targets.items() if self.then_gptq}
        for group in probe.groups:
            why = self._unbalanced(prefix, group, modules, probe)
            if why is not None:
                for n in group.linears:
                    notes.setdefault(n, rounded(METHOD, why))
                continue
            note, changed = self._balance(prefix, group, modules, probe)
            probe.forget(group)
            for n in group.linears:
                notes[n] = note
            if group.previous in changed:  # its output rows carry the next group's scales
                rows = f"output rows scaled by {METHOD} for {', '.join(group.linears)}"
                notes[group.previous] = f"{notes.get(group.previous, METHOD)}; {rows}"
            scaled |= changed
        hessians = _hessians(probe, targets) if self.then_gptq else None
        for local, linear in targets.items():
            name = f"{prefix}{local}.weight"
            method = METHOD if local in scaled else "rtn"
            note = notes.get(local, rounded(METHOD, "in no balanced group"))
            if hessians is not None:
                found = [hessians.take(local, s) for s in STREAMS]
                method, note = self._gptq(name, local, linear, method, note, originals, found)
            else:
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
                return probe.error(stream, group)
            finally:
                for m, w in zip(linears, originals, strict=True):
                    m.weight.copy_(w)

        x_mean = probe.means[group.previous].mean
        try:
            w_mean = awq.weight_means(originals, spec)
        except ValueError as err:  # a grid across output rows (channels on axis 1)
            return rounded(METHOD, str(err)), set()
        try:
            choice = awq.search(lambda s: error("fit", s), x_mean, w_mean)
        except awq.NonFiniteLoss:
            return rounded(METHOD, "every candidate's output error was NaN or infinite"), set()
        ones = torch.ones_like(choice.scales)
        if torch.equal(choice.scales, ones):  # the identity won on the fit windows
            return rounded(METHOD, "round to nearest had the least output error"), set()
        held, check = (
            change(error(s, choice.scales), error(s, ones)) if probe.inputs[s] else None
            for s in ("held", "check")
        )
        verdict = judge(held, check, self.calibration.guard, self.calibration.tolerance)
        if not verdict.keep:
            return describe(METHOD, verdict), set()
        fold(probe.block, group, choice.scales)
        changed = set(group.linears)
        before = modules[group.previous]
        self.columns |= dict.fromkeys(group.linears, choice.scales)
        if isinstance(before, torch.nn.Linear):
            self.rows[group.previous] = choice.scales
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
        result = kernels.quantize_with(source, target.spec, scale_dtype=self._scale_dtype(target))
        reconstruction = restored(result, target.spec, target.dtype, tuple(weight.shape))
        if scaled:
            errors = error_stats(weight, reconstruction)
            result = kernels.QuantizedTensor(
                result.q, result.scale, result.zero_point, errors, method=METHOD
            )
            self.spill.put(name, target.spec, result)
        linear.weight.data.copy_(reconstruction)

    def _gptq(
        self,
        name: str,
        local: str,
        linear: torch.nn.Linear,
        method: str,
        note: str,
        originals: dict[str, torch.Tensor],
        hessians: list[torch.Tensor | None],
    ) -> tuple[str, str]:
        """awq+gptq: GPTQ's codes of the Linear's weight as AWQ left it (scaled or not), from
        the Hessians of its inputs in the smoothed block, kept where the guard prefers them to
        that weight rounded to nearest (what the Linear gets otherwise); the note also gives
        their change against rounding of the ORIGINAL weight. Errors are compared in the
        original model's output units (a Linear whose rows a later fold divided, weighted
        back). (method, note)."""
        fit, held, check = hessians
        target = self.targets[name]
        spec, scale_dtype = target.spec, self._scale_dtype(target)
        why = gptq.unsupported(spec)
        if why is None and held is None and self.calibration.guard is not Guard.NONE:
            why = "no held-out window reached this Linear, so no verdict"
        if why is None and fit is None:
            why = "no calibration input reached this Linear"
        if why is None and fit is not None:
            solved = gptq.gptq_quantize(
                linear.weight.detach().float(), fit, spec, scale_dtype=scale_dtype,
                dynamic_groups=self.calibration.dynamic_groups,
            )  # fmt: skip
            if solved.fallback is not None:
                why = solved.fallback.value
        if why is not None:
            self._round(name, linear, method)
            return method, f"{note}; {method}, gptq: {why}"
        weight = linear.weight.detach().float()
        source = weight if method == METHOD else weight.to(target.dtype)
        shape = tuple(weight.shape)
        rtn = restored(kernels.quantize_with(source, spec, scale_dtype=scale_dtype), spec,
                       target.dtype, shape)  # fmt: skip
        result = solved.quantized(spec)
        chosen = restored(result, spec, target.dtype, shape)
        delta, baseline = chosen - source, rtn - source
        rows = self.rows.get(local)
        if rows is not None:  # its outputs are the original's divided by these scales
            delta, baseline = delta * rows[:, None], baseline * rows[:, None]
        verdict = judge(
            output_change(delta, baseline, held), output_change(delta, baseline, check),
            self.calibration.guard, self.calibration.tolerance,
        )  # fmt: skip
        figures = describe_figures(verdict.in_domain, verdict.check)
        if method == METHOD:  # also against rounding of the original weight, unsmoothed
            figures = f"{figures} against awq; " + self._against_rtn(
                local, originals[local], target, delta, held, check
            )
        verdict_note = f"gptq: {figures}" if verdict.keep else f"{method}, gptq: {figures}"
        if not verdict.keep:
            self._round(name, linear, method)
            return method, f"{note}; {verdict_note}"
        errors = error_stats(source, chosen)
        label = THEN_GPTQ if method == METHOD else "gptq"
        self.spill.put(name, spec, kernels.QuantizedTensor(
            result.q, result.scale, result.zero_point, errors, method=label
        ))  # fmt: skip
        linear.weight.data.copy_(chosen)
        return label, f"{note}; {verdict_note}"

    def _against_rtn(
        self,
        local: str,
        original: torch.Tensor,
        target: Target,
        delta: torch.Tensor,
        held: torch.Tensor | None,
        check: torch.Tensor | None,
    ) -> str:
        """'-60% held out, -20% check text against rtn': GPTQ's output error (delta, in the
        smoothed inputs' space) against rounding of the original weight, whose error on the
        smoothed inputs is (Q(W) - W) diag(s)."""
        source = original.float().to(target.dtype)
        rtn = kernels.quantize_with(source, target.spec, scale_dtype=self._scale_dtype(target))
        shape = tuple(source.shape)
        baseline = restored(rtn, target.spec, target.dtype, shape) - source.float()
        columns = self.columns.get(local)
        if columns is not None:
            baseline = baseline * columns[None, :]
        figures = describe_figures(
            output_change(delta, baseline, held), output_change(delta, baseline, check)
        )
        return f"{figures} against rtn"

    def _scale_dtype(self, target: Target) -> torch.dtype:
        return target.dtype if self.scales_in_weight_dtype else torch.float32


def _hessians(probe: AwqProbe, linears: dict[str, torch.nn.Linear]) -> HessianProbe:
    """awq+gptq: the Hessians of `linears`' inputs per stream, from one more pass of the block
    as the folds left it (float, smoothed) on the inputs pass 1 kept."""
    found = HessianProbe(linears)
    with found, torch.no_grad():
        for stream in STREAMS:
            found.stream = stream
            for x in probe.inputs[stream]:
                probe.block(x, **probe.kwargs)
    return found


def output_buffers(
    windows: int, ctx: int, width: int, device: torch.device, mapped: Sequence[torch.Tensor] | None
) -> list[torch.Tensor]:
    """One (1, ctx, width) float32 buffer per window: `mapped` (sequential.spilled's file, past
    its bound) or new tensors on `device`."""
    if mapped is not None:
        return list(mapped)
    return [torch.empty(1, ctx, width, device=device) for _ in range(windows)]
