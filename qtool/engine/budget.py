"""The error budget in a run (--target-sqnr): passes 4 and 5 of the plan (engine/plan.py), and
what the budget costs and saves. The per-tensor choice itself is numerics/budget.py.

Pass 4 reads each tensor the budget decides once, tries the ladder on it, and keeps the chosen
codes in a Spill for the writing pass; pass 5 puts the siblings a consumer fuses on one spec.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from qtool.engine import nonfinite
from qtool.engine.decision import (
    Budget,
    FusedSiblings,
    Keep,
    Quantize,
    TensorPlan,
)
from qtool.engine.job import Job
from qtool.engine.loop import Kernels, quantize_one
from qtool.engine.plan import ModelPlan, QuantizeOptions, plan_data
from qtool.engine.shards import Shards
from qtool.engine.sizes import qparam_nbytes, stored_nbytes
from qtool.engine.spill import Spill
from qtool.formats import registry
from qtool.formats.base import OutputFormat
from qtool.io.checkpoint import Checkpoint
from qtool.numerics import budget, kernels
from qtool.numerics.ranges import NonFiniteInput
from qtool.spec import INT8_CHANNEL, Codec, fit_spec


@contextmanager
def data_passes(
    job: Job, plan: ModelPlan, spill_directory: Path | None
) -> Iterator[tuple[ModelPlan, Spill | None]]:
    """The plan after its passes 4-7 (engine.plan.plan_data), and the Spill where the codes the
    budget chose wait for the writing pass: a temporary file in `spill_directory` (None: a dry
    run, which keeps only their figures), dropped when the context ends."""
    assert job.kernels is not None
    calibration = job.options.calibration
    asks = job.options.budgeted or calibration is not None
    spill = Spill(spill_directory) if asks else None
    try:
        if calibration is not None and spill is not None:  # its codes wait in the spill
            from qtool.engine.methods.run import calibrated

            plan = calibrated(job, plan, spill)
        data = Measured(job.shards, job.options, job.fmt, job.kernels, spill)
        yield plan_data(plan, job.options, job.fmt, data), spill
    finally:
        if spill is not None:
            spill.close()


class Measured:
    """The plan's passes that read the tensors (engine.plan.DataPasses), for one run."""

    def __init__(
        self,
        shards: Shards,
        options: QuantizeOptions,
        fmt: OutputFormat,
        run: Kernels,
        spill: Spill | None,
    ) -> None:
        self.shards, self.options, self.fmt, self.run, self.spill = (
            shards, options, fmt, run, spill
        )  # fmt: skip

    def choose(self, plan: ModelPlan) -> ModelPlan:
        """Pass 4: each tensor the budget decides, read once and given the cheapest ladder spec
        the format stores that reaches the target (or kept float), or the allocation's
        (engine/allocate.py); the checkpoints stay open for the writing pass."""
        if self.options.allocation is not None:
            from qtool.engine.allocate import allocate

            return allocate(plan, self)
        assert self.options.target_sqnr is not None
        self.run.expect(plan.plans)
        out: list[TensorPlan] = []
        for shard, plans in plan.per_shard():
            ckpt = self.shards.checkpoint(shard)
            workspace = kernels.Workspace(self.run.device)
            out += [self._choose(ckpt, p, workspace) if p.decision.budget else p for p in plans]
        return plan.with_plans(out)

    def align(self, plans: tuple[TensorPlan, ...]) -> list[TensorPlan]:
        return align_fused(plans, self.fmt.fused_key)

    def guard(self, plan: ModelPlan) -> ModelPlan:
        return nonfinite.guard(plan, self.shards)

    def _choose(
        self, ckpt: Checkpoint, plan: TensorPlan, workspace: kernels.Workspace
    ) -> TensorPlan:
        entry, target = plan.entry, self.options.target_sqnr
        assert target is not None
        ladder = budget.candidates(ladder_of(self.options), entry.shape)
        refusals = {s: self.fmt.supports(entry, s) for s in ladder}
        fitting = [s for s, refused in refusals.items() if refused is None]
        if not fitting:
            why = next(iter(refusals.values()), None)
            keep = Keep(f"kept float: no ladder spec fits {self.fmt.name} ({why})")
            return TensorPlan(entry, plan.decision.then(keep, Budget(target)))
        keep_nan = self.options.keep_nonfinite
        weight_dtype = self.run.scales_in_weight_dtype
        return choose_plan(
            ckpt, plan, fitting, target, workspace, keep_nan, weight_dtype, self.spill
        )


def ladder_of(options: QuantizeOptions) -> tuple[Codec, ...]:
    """The specs the budget tries: the recipe's ladder, else the output format's default
    (GGUF: Q4_K, Q5_K, Q6_K, Q8_0), else qtool's; an allocation's default is its own
    (engine/allocate.py: every spec the format stores that it offers)."""
    recipe = options.recipe
    if recipe is not None and recipe.ladder:
        return recipe.ladder
    if options.allocation is not None:
        from qtool.engine.allocate import allocation_ladder

        return allocation_ladder(options.format.value)
    return registry.entry(options.format.value).ladder or budget.DEFAULT_LADDER


def choose_plan(
    ckpt: Checkpoint,
    plan: TensorPlan,
    ladder: Sequence[Codec],
    target: float,
    workspace: kernels.Workspace,
    keep_nan: bool,
    weight_dtype: bool = False,
    spill: Spill | None = None,
) -> TensorPlan:
    """The plan with the budget's choice: the cheapest ladder spec reaching `target`, or kept
    in float; NaN/Inf tensors are left to --keep-nonfinite (or fail as in a plain run).
    `weight_dtype`: scales rounded to the weight's dtype, as the format stores them; `spill`
    keeps the chosen quantization for the writing pass."""
    x = ckpt.tensor(plan.entry).to(workspace.device)
    scale_dtype = x.dtype if weight_dtype else torch.float32
    try:
        choice = budget.choose(x, ladder, target, scale_dtype=scale_dtype, workspace=workspace)
    except NonFiniteInput:
        if keep_nan and (kept := nonfinite.kept_nonfinite(plan, x)) is not None:
            return kept
        quantize_one(ckpt, plan, workspace)  # raises the run's own NumericError
        raise
    finally:
        ckpt.release(plan.entry)
    origin = Budget(target, choice.trials)
    if choice.spec is None:
        return TensorPlan(plan.entry, plan.decision.then(Keep(choice.reason()), origin))
    if spill is not None and choice.result is not None:
        spill.put(plan.entry.name, choice.spec, choice.result)
    chosen = Quantize(choice.spec, choice.reason())
    return TensorPlan(plan.entry, plan.decision.then(chosen, origin))


def align_fused(plans: Sequence[TensorPlan], key: Callable[[str], str | None]) -> list[TensorPlan]:
    """Pass 5: each set of fused siblings (same `key`) quantized alike: the budget's tensors
    take the spec of a sibling the budget did not decide (a rule fixed it, the format kept it),
    else the dearest of their own choices (kept float is dearest), so that every member still
    meets the target as far as the ladder is ordered by quality. A member moved off its own
    choice says so in its note."""
    sets: dict[str, list[int]] = {}
    for i, p in enumerate(plans):
        k = key(p.entry.name)
        if k is not None:
            sets.setdefault(k, []).append(i)
    out = list(plans)
    for k, members in sets.items():
        chosen = [plans[i] for i in members if plans[i].decision.budget]
        if not chosen or len({p.spec for p in (plans[i] for i in members)}) == 1:
            continue
        fixed = [plans[i] for i in members if not plans[i].decision.budget]
        pick = fixed[0] if fixed else max(chosen, key=_dearness)
        for i in members:
            if plans[i].decision.budget and plans[i].spec != pick.spec:
                out[i] = _aligned(plans[i], pick, k)
    return out


def _dearness(plan: TensorPlan) -> float:
    """Order of the budget's choices: bytes per element, kept float last."""
    if plan.spec is None:
        return math.inf
    return budget.bytes_per_tensor(plan.spec, plan.entry.shape) / plan.entry.numel


def _aligned(plan: TensorPlan, pick: TensorPlan, key: str) -> TensorPlan:
    own = plan.decision.note or plan.decision.reason
    why = f"aligned with its fused siblings {key}; own choice {own}"
    action = Keep(f"kept float: {why}") if pick.spec is None else Quantize(pick.spec, why)
    return TensorPlan(plan.entry, plan.decision.then(action, FusedSiblings(key)))


def needed_bytes(plans: Sequence[TensorPlan], options: QuantizeOptions) -> int:
    """Free space to ask for: the outputs, each tensor the error budget decides counted at the
    most it can take (kept float, or its dearest candidate) plus its dearest candidate again
    (its codes kept between the two passes)."""
    ladder = ladder_of(options)
    total = 0
    for p in plans:
        if p.decision.budget:
            dearest = max(budget.bytes_per_tensor(s, p.entry.shape) for s in ladder)
            total += max(p.entry.nbytes, dearest) + dearest
        else:
            total += p.out_nbytes
    return total


def budget_sizes(plans: Sequence[TensorPlan], fmt: OutputFormat) -> tuple[int, int]:
    """The output size had the budget's tensors all been int8 (sym, per channel, min-max),
    and had they all stayed float."""
    return _size_if(plans, fmt, INT8_CHANNEL), _size_if(plans, fmt, None)


def _size_if(plans: Sequence[TensorPlan], fmt: OutputFormat, spec: Codec | None) -> int:
    """The output size (codes and qparams) had every tensor the budget decided been
    quantized with `spec` (None: kept), as the format stores it."""
    total = 0
    for plan in plans:
        if not plan.decision.budget:
            total += plan.out_nbytes + plan.qparam_nbytes
            continue
        entry = plan.entry
        fitted = fit_spec(spec, entry.shape)[0] if spec is not None else None
        stored = fmt.stored_nbytes(entry, fitted)
        if stored is None:
            stored = stored_nbytes(entry, fitted) + qparam_nbytes(entry, fitted)
        total += stored
    return total
