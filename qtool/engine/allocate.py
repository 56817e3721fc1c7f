"""The allocation in a run (--target-size, --target-bpw, --target-kl): pass 4 of the plan for
the tensors the budget decides (engine/budget.py's Measured.choose hands them here), and the
files that reproduce its plan. The solver is numerics/allocate.py.

Each tensor is read once and quantized with every ladder spec the format stores (and kept
float); each candidate's bytes are those the output writes (fmt.stored_nbytes, else codes and
sidecar), its r the relative output error: with an imatrix sum_j h_j ||dW[:,j]||^2 /
sum_j h_j ||W[:,j]||^2 (weighted_error), without one the relative weight error. Its loss is
alpha_L x r with alpha_L from the imatrix's sensitivities (qtool calibrate), else 1. Fused
siblings (fmt.fused_key) are one item of the knapsack with one spec for all. The chosen codes
are not kept: the writing pass quantizes each tensor again with its chosen spec (the same codes:
quantization is deterministic).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from qtool.engine.decision import Budget, Keep, Quantize, TensorPlan
from qtool.engine.importance import weighted_error
from qtool.engine.loop import quantize_one
from qtool.engine.plan import ModelPlan, QuantizeOptions
from qtool.engine.sizes import qparam_nbytes, stored_nbytes
from qtool.errors import InputError, UsageError
from qtool.numerics import allocate as solver
from qtool.numerics import budget, kernels
from qtool.numerics.range_methods import GridOverflow
from qtool.results import AllocationPlan, Trial
from qtool.spec import Codec, QSpec, spec_label

if TYPE_CHECKING:
    import torch

    from qtool.engine.loop import Kernels
    from qtool.engine.shards import Shards
    from qtool.formats.base import OutputFormat
    from qtool.formats.imatrix.sensitivity import Sensitivities
    from qtool.io.checkpoint import Checkpoint
    from qtool.io.gguf_layout import GGUFValue
    from qtool.io.stformat import TensorEntry

FLOAT = "float"  # the candidate that keeps a tensor as it is
LADDERS = {
    "gguf": ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),
    "grid": ("int4 g32 mse", "int4 g64 mse", "int4 g128 mse", "int4 channel mse", "int8"),
}
"""The allocation's default ladders (besides keeping float): GGUF's block types, else
qtool's and compressed-tensors' integer grids; the format drops what it cannot store."""


def ladder_of(options: QuantizeOptions) -> tuple[Codec, ...]:
    """The recipe's ladder, else the format's allocation ladder (float is offered besides)."""
    recipe = options.recipe
    if recipe is not None and recipe.ladder:
        return recipe.ladder
    return allocation_ladder(options.format.value)


def allocation_ladder(fmt: str) -> tuple[Codec, ...]:
    from qtool.spec import parse_spec_label

    labels = LADDERS["gguf" if fmt == "gguf" else "grid"]
    return tuple(parse_spec_label(label, writable=True) for label in labels)


class Measured(Protocol):
    """What the pass reads with (engine/budget.py's Measured, which hands the plan here)."""

    shards: Shards
    options: QuantizeOptions
    fmt: OutputFormat
    run: Kernels


@dataclass(frozen=True)
class Measurement:
    """One tensor's candidates: label -> (spec or None for float, bytes, r)."""

    plan: TensorPlan
    options: dict[str, tuple[Codec | None, int, float]]


def allocate(plan: ModelPlan, data: Measured) -> ModelPlan:
    """Pass 4 for an allocation target: every tensor the budget decides measured, the knapsack
    solved, each tensor given its candidate; a note says the plan's size, bpw and loss."""
    target = data.options.allocation
    assert target is not None and data.run is not None
    where = data.options.imatrix
    alpha, found, metadata = sensitivities(plan, data)
    if target.kind == "kl" and found is None:
        raise UsageError(
            where,
            "a KL target needs sensitivities (alpha per Linear): "
            + ("this imatrix holds none" if where else "no imatrix was given")
            + "; calibrate with sensitivities, or aim at a size",
            hint="sensitivity",
        )
    if found is not None and not alpha:
        if target.kind == "kl":
            raise UsageError(
                where, "its sensitivities name none of the tensors the target decides (a file "
                "of another model?): calibrate this model with sensitivities, or aim at a size",
                hint="sensitivity",
            )  # fmt: skip
        found = None  # a size target: relative error, alpha = 1, as without sensitivities
    if found is not None and target.kind == "kl" and not any(alpha.values()):
        raise InputError(
            where, "its sensitivities say nothing: every alpha of the tensors the target decides "
            "is 0, so every plan predicts KL 0; calibrate this model with sensitivities again, "
            "or aim at a size",
            hint="sensitivity",
        )  # fmt: skip
    # a tensor the file has no alpha for has no KL cost to weigh: kept float, outside the plan
    unmeasured = set() if found is None else _without_alpha(plan, alpha, data.fmt)
    _refuse_unmeasured_statistics(data, unmeasured)
    measured = _measure(plan, data, unmeasured)
    fixed = sum(p.out_nbytes + p.qparam_nbytes for p in plan.plans if not p.decision.budget)
    fixed += sum(stored_bytes(data.fmt, p.entry, None) for p in plan.plans
                 if p.entry.name in unmeasured)  # fmt: skip
    items = _items(measured, alpha, data.fmt)
    elements = sum(p.entry.numel for p in plan.plans)
    check: KlCheck | None = None
    try:
        if target.kind == "kl":
            assert found is not None
            chosen, check = _within_kl(plan, data, measured, items, found, metadata, fixed)
        else:
            chosen = solver.within_bytes(items, target.bytes_for(elements) - fixed)
    except solver.Infeasible as err:
        # least is bytes for a size target, sum alpha r for a KL one (only that is predicted)
        least = err.least
        if found is not None and target.kind == "kl":
            least = found.predicted(least)
        why = _infeasible(target, least, fixed, _unstorable(measured, data), elements)
        raise UsageError(None, why, hint="target") from None
    except ValueError as err:  # a KL target over more tensors than the table has units
        raise UsageError(None, f"{err}; aim at a size", hint="target") from None
    picks = _picks(measured, chosen, data.fmt)
    by_name = {m.plan.entry.name: m for m in measured}
    out = []
    for p in plan.plans:
        m = by_name.get(p.entry.name)
        if p.entry.name in unmeasured:
            out.append(_kept_unmeasured(p, target, where))
        else:
            out.append(p if m is None else _decided(m, picks[p.entry.name], target))
    total = fixed + chosen.nbytes
    spent: dict[str, tuple[int, int]] = {}  # label -> (tensors, bytes), fused members each
    for m in measured:
        label = picks[m.plan.entry.name]
        n, b = spent.get(label, (0, 0))
        spent[label] = (n + 1, b + m.options[label][1])
    predicted = chosen.loss if found is None else found.predicted(chosen.loss)
    result = AllocationPlan(
        target.kind, target.value, total, 8 * total / max(1, elements), predicted,
        found is not None, chosen.granularity,
        tuple((label, n, b) for label, (n, b) in sorted(spent.items())),
        sum_alpha_r=chosen.loss, joint_fit=found is not None and found.joint is not None,
        kept_without_alpha=len(unmeasured),
        measured_kl=math.nan if check is None else check.kl,
        solves=0 if check is None else check.solves,
        measured_on="" if check is None else check.where,
        rounds=() if check is None else check.rounds,
    )  # fmt: skip
    # summary_line(target, result) is the report's note under the table (not a warning)
    return replace(plan, plans=tuple(out), allocation=result)


@dataclass(frozen=True)
class KlCheck:
    """What a KL target's plan measured (engine/plan_kl.py): its KL on held-out windows
    (`where` says which), after `solves` solves; or why it was not measured (`kl` NaN)."""

    kl: float
    solves: int
    where: str
    rounds: tuple[tuple[int, float, float], ...] = ()  # per solve: output bytes, predicted, KL


def _within_kl(
    plan: ModelPlan,
    data: Measured,
    measured: Sequence[Measurement],
    items: Sequence[solver.TensorLadder],
    found: Sensitivities,
    metadata: dict[str, GGUFValue],
    fixed: int,
) -> tuple[solver.Plan, KlCheck]:
    """The fewest bytes whose KL stays within the target, measured: the plan of least bytes
    within the predicted target, its KL measured on held-out windows; while over the target,
    solved again within a bound tightened by measured / predicted (sensitivity.tightened), at
    most MAX_SOLVES solves; UsageError when the last is still over. A model qtool cannot run
    keeps the first plan, predicted only (the check says why)."""
    from qtool.engine import plan_kl
    from qtool.numerics.sensitivity import MAX_SOLVES, tightened

    target = data.options.allocation
    assert target is not None
    bound = target.value
    chosen = solver.within_loss(items, found.sum_within(bound))
    why = plan_kl.cannot_run(data.shards.source.directory)
    if why is not None:
        return chosen, KlCheck(math.nan, 1, f"not measured: {why}")
    directory = data.shards.source.directory
    assert directory is not None
    rounds: list[tuple[int, float, float]] = []
    errors = _items(measured, {}, data.fmt)  # r unweighted: alpha 0 makes every loss equal
    with plan_kl.PlanKL(directory, data.run.device, metadata) as meter:
        for solves in range(1, MAX_SOLVES + 1):
            picks = _picks(measured, chosen, data.fmt)
            restore = _Restorer(plan, data, measured, picks)
            kl = meter.measure(restore)
            missing = restore.quantized - meter.placed
            if missing:
                why = f"{len(missing)} quantized tensor(s) it cannot place, e.g. {min(missing)}"
                return chosen, KlCheck(math.nan, solves, f"not measured: {why}")
            predicted = found.predicted(chosen.loss)
            rounds.append((fixed + chosen.nbytes, predicted, kl))
            if not math.isfinite(kl):
                raise InputError(directory, f"the plan's KL on {meter.held.describe()} is "
                                 f"{kl} (not finite)")  # fmt: skip
            if kl <= target.value:
                return chosen, KlCheck(kl, solves, meter.held.describe(), tuple(rounds))
            if _least_error(chosen, errors):  # nothing left to buy: the KL is the rules' tensors
                raise UsageError(
                    None, f"no plan reaches KL {target.value:g}: with every tensor the target "
                    f"decides at its least error the model measures {kl:.4g} on "
                    f"{meter.held.describe()} (the tensors rules quantize); aim higher",
                    hint="target",
                )  # fmt: skip
            if solves == MAX_SOLVES:
                raise UsageError(
                    None, f"no plan reached KL {target.value:g} in {_solves(MAX_SOLVES)}: the "
                    f"last, {solver.human_bytes(fixed + chosen.nbytes)} predicted {predicted:.4g}, "
                    f"measured {kl:.4g} on {meter.held.describe()}; aim higher",
                    hint="target",
                )  # fmt: skip
            bound = tightened(target.value, bound, predicted, kl)
            try:
                chosen = solver.within_loss(items, found.sum_within(bound))
            except solver.Infeasible as floor:  # tightened below what the ladder reaches:
                chosen = solver.within_loss(items, floor.least * (1 + 1e-12))  # its least
    raise AssertionError("unreachable")


def _least_error(chosen: solver.Plan, errors: Sequence[solver.TensorLadder]) -> bool:
    """Whether every item of `chosen` has its least error (`errors`: the items unweighted by
    alpha, in its order): compared by error, not by alpha x error, which is 0 for every
    candidate of a tensor whose alpha is 0 and so least at the cheapest one."""
    for picked, item in zip(chosen.chosen, errors, strict=True):
        least = min(c.r for c in item.candidates)
        if next(c.r for c in item.candidates if c.label == picked.label) > least:
            return False
    return True


def _solves(n: int) -> str:
    return f"{n} solve{'' if n == 1 else 's'}"


class _Restorer:
    """plan_kl.Restore for a plan: each tensor the plan quantizes, quantized as the writing
    pass quantizes it (its chosen spec, the imatrix's weights) and restored from its codes."""

    def __init__(
        self,
        plan: ModelPlan,
        data: Measured,
        measured: Sequence[Measurement],
        picks: Mapping[str, str],
    ) -> None:
        self.data = data
        by_name = {m.plan.entry.name: m for m in measured}
        self.planned: dict[str, tuple[Path, TensorPlan]] = {}
        for shard, plans in plan.per_shard():
            for p in plans:
                m = by_name.get(p.entry.name)
                spec = m.options[picks[p.entry.name]][0] if m is not None else (
                    None if p.decision.budget else p.spec)  # fmt: skip
                if spec is not None:
                    trial = p.decision.then(Quantize(spec), p.decision.origin)
                    self.planned[p.entry.name] = (shard, TensorPlan(p.entry, trial))
        self.quantized = set(self.planned)
        self.workspace = kernels.Workspace(data.run.device)

    def __call__(self, name: str) -> torch.Tensor | None:
        found = self.planned.get(name)
        if found is None:
            return None
        shard, trial = found
        run, spec = self.data.run, trial.spec
        assert spec is not None
        ckpt = self.data.shards.checkpoint(shard)
        result = quantize_one(ckpt, trial, self.workspace, run.scales_in_weight_dtype,
                              weights=run.weights_for_codes(run.weights(trial)))  # fmt: skip
        x = ckpt.tensor(trial.entry)
        try:
            return kernels.restored_rows(result, spec, 0, x.shape[0], x).clone()
        finally:
            ckpt.release(trial.entry)


def summary_line(target: solver.Target, plan: AllocationPlan) -> str:
    """'allocation (size 100 MiB ...): 99.9 MiB (...), 4.41 bpw, predicted KL 0.0312
    nats/token; by spec: int4 g64 mse x140 60.1 MiB (...), ...'."""
    what = "predicted KL" if plan.measured else "predicted loss (relative output error, alpha = 1)"
    if plan.measured:
        fit = "the imatrix's joint fit" if plan.joint_fit else "no joint fit in the imatrix: KL = S"
        what = f"{what} {plan.loss:.4g} nats/token (S = sum alpha r {plan.sum_alpha_r:.4g}, {fit})"
        if plan.kept_without_alpha:
            what += f", {plan.kept_without_alpha} tensor(s) with no alpha kept float"
    else:
        what = f"{what} {plan.loss:.4g}"  # as the KL figures: 4 significant digits
    if plan.target == "kl" and plan.solves:
        solves = _solves(plan.solves)
        if math.isnan(plan.measured_kl):
            what = f"KL {plan.measured_on} ({solves}), {what}"
        else:
            what = f"measured KL {plan.measured_kl:.4g} nats/token on {plan.measured_on} " \
                f"({solves}), {what}"  # fmt: skip
    parts = [f"{lb} x{n} {solver.human_bytes(b)}" for lb, n, b in plan.by_spec]
    return (
        f"allocation ({target.describe()}): {solver.human_bytes(plan.nbytes)}, "
        f"{plan.bpw:.3f} bpw, {what}; "
        f"by spec: {', '.join(parts)} (granularity {plan.granularity} "
        f"byte{'' if plan.granularity == 1 else 's'})"
    )


def sensitivities(
    plan: ModelPlan, data: Measured
) -> tuple[dict[str, float], Sensitivities | None, dict[str, GGUFValue]]:
    """alpha of each tensor the budget decides, by checkpoint name, the sensitivities the run's
    imatrix holds (None: no imatrix, or none in it) and its metadata. A tensor's alpha is
    looked up under its llama.cpp name (calibrate's map, whether or not the file has statistics
    for it: the embedding's and the head's alpha have none), its entry's name, and its own. The
    file is read again for its metadata, and refused if it changed since the first read."""
    importance = data.run.importance
    if importance is None:
        return {}, None, {}
    from qtool.formats.imatrix import read_imatrix_file
    from qtool.formats.imatrix.sensitivity import read_sensitivities

    read = read_imatrix_file(importance.path)
    if read.sha256 != importance.provenance.sha256:
        raise InputError(importance.path, "changed while the run read it; run again")
    found = read_sensitivities(importance.path, read.metadata)
    if found is None:
        return {}, None, dict(read.metadata)
    keyed = (importance.llama or {}, importance.entry_names or {})
    alpha = {}
    for p in plan.plans:
        name = p.entry.name
        held = [k for k in (*(m.get(name, name) for m in keyed), name) if k in found.alpha]
        if p.decision.budget and held:
            alpha[name] = found.alpha[held[0]]
    return alpha, found, dict(read.metadata)


def _without_alpha(plan: ModelPlan, alpha: Mapping[str, float], fmt: OutputFormat) -> set[str]:
    """The tensors the budget decides that have no alpha, with their fused siblings (one spec
    for all: a set is allocated whole or kept whole)."""
    decided = [p.entry.name for p in plan.plans if p.decision.budget]
    missing = {fmt.fused_key(n) or n for n in decided if n not in alpha}
    return {n for n in decided if (fmt.fused_key(n) or n) in missing}


def _refuse_unmeasured_statistics(data: Measured, unmeasured: set[str]) -> None:
    """UsageError when a tensor without alpha has statistics in the imatrix: the run that
    wrote it saw the tensor, yet its sensitivity pass measured none for it (a mixture of
    experts: it measures attention, the embedding and the head, no expert or router). Kept
    float, every such tensor would be left out of the budget, the bulk of the model."""
    importance = data.run.importance
    if importance is None or not unmeasured:
        return
    seen = sorted(n for n in unmeasured if n in importance.stats)
    if not seen:
        return
    # an expert's statistics are a row of its stacked entry, no entry of its own
    experts = [n for n in seen if n not in (importance.entry_names or {})]
    what = (
        "no expert of this mixture of experts (the sensitivity pass measures attention, the "
        f"embedding and the head: {len(seen)} expert and router tensors have none, e.g. "
        f"{experts[0]})"
        if experts
        else f"none of {len(seen)} tensors its statistics weigh (e.g. {seen[0]})"
    )
    raise UsageError(
        data.options.imatrix, f"its sensitivities were measured for {what}: the allocation "
        "would keep every one float; aim the target with an imatrix without sensitivities",
        hint="no-sensitivity",
    )  # fmt: skip


def _kept_unmeasured(p: TensorPlan, target: solver.Target, imatrix: Path | None) -> TensorPlan:
    why = f"kept float: allocation: {imatrix} has no sensitivity (alpha) for it"
    return TensorPlan(p.entry, p.decision.then(Keep(why), Budget(math.nan, (), target.describe())))


def _measure(plan: ModelPlan, data: Measured, skip: set[str]) -> list[Measurement]:
    """Each tensor the budget decides (but `skip`), read once, every candidate's bytes and r."""
    run = data.run
    run.expect(plan.plans)
    out: list[Measurement] = []
    for shard, plans in plan.per_shard():
        ckpt = data.shards.checkpoint(shard)
        workspace = kernels.Workspace(run.device)
        for p in plans:
            if not p.decision.budget or p.entry.name in skip:
                continue
            ladder = budget.candidates(ladder_of(data.options), p.entry.shape)
            fitting = [s for s in ladder if data.fmt.supports(p.entry, s) is None]
            options: dict[str, tuple[Codec | None, int, float]] = {
                FLOAT: (None, stored_bytes(data.fmt, p.entry, None), 0.0)
            }
            for spec in fitting:
                r = _relative_error(ckpt, p, spec, workspace, run.scales_in_weight_dtype, run)
                if r is not None:
                    options[spec_label(spec)] = (spec, stored_bytes(data.fmt, p.entry, spec), r)
            ckpt.release(p.entry)
            out.append(Measurement(p, options))
    return out


def _relative_error(
    ckpt: Checkpoint,
    plan: TensorPlan,
    spec: Codec,
    workspace: kernels.Workspace,
    weight_dtype: bool,
    run: Kernels,
) -> float | None:
    """r of `plan`'s tensor under `spec` (None: the spec cannot store it, e.g. its scales
    overflow), weighted by the imatrix's h where it has the tensor's entry."""
    trial = TensorPlan(plan.entry, plan.decision.then(Quantize(spec), plan.decision.origin))
    weights = run.weights(trial)
    try:
        result = quantize_one(
            ckpt, trial, workspace, weight_dtype, weights=run.weights_for_codes(weights)
        )
    except GridOverflow:
        return None
    if weights is not None:
        w = weighted_error(ckpt, trial, result, weights)
        err, sig = w.sq_error, w.sq_signal
    else:
        assert result.errors is not None
        err, sig = result.errors.sq_error, result.errors.sq_signal
    if sig == 0.0:
        return 0.0 if err == 0.0 else None
    r = err / sig
    return r if math.isfinite(r) else None


def stored_bytes(fmt: OutputFormat, entry: TensorEntry, spec: Codec | None) -> int:
    """The bytes the output writes for the tensor: the format's count where it has one, else
    codes (or the float values) and the sidecar's qparams."""
    stored = fmt.stored_nbytes(entry, spec)
    if stored is not None:
        return stored
    return stored_nbytes(entry, spec) + qparam_nbytes(entry, spec)


def _items(
    measured: Sequence[Measurement], alpha: Mapping[str, float], fmt: OutputFormat
) -> list[solver.TensorLadder]:
    """One knapsack item per tensor, or per set of fused siblings (the labels all of them
    have, bytes and alpha x r summed), in plan order; each candidate's r is alpha x r (alpha 1
    for a tensor `alpha` lacks: only without sensitivities, the relative error alone)."""
    groups: dict[str, list[Measurement]] = {}
    for m in measured:
        key = fmt.fused_key(m.plan.entry.name)
        groups.setdefault(m.plan.entry.name if key is None else f"fused:{key}", []).append(m)
    items = []
    for name, members in groups.items():
        labels = [lb for lb in members[0].options if all(lb in m.options for m in members)]
        cands = []
        for label in labels:
            nbytes = sum(m.options[label][1] for m in members)
            loss = 0.0
            for m in members:
                loss += alpha.get(m.plan.entry.name, 1.0) * m.options[label][2]
            cands.append(solver.Candidate(label, nbytes, loss))
        items.append(solver.TensorLadder(name, tuple(cands)))
    return items


def _picks(measured: Sequence[Measurement], plan: solver.Plan, fmt: OutputFormat) -> dict[str, str]:
    """tensor name -> chosen label (a fused set's label for each of its members)."""
    chosen = dict(zip(plan.names, (c.label for c in plan.chosen), strict=True))
    out = {}
    for m in measured:
        name = m.plan.entry.name
        key = fmt.fused_key(name)
        out[name] = chosen[name if key is None else f"fused:{key}"]
    return out


def _decided(m: Measurement, label: str, target: solver.Target) -> TensorPlan:
    trials = tuple(
        Trial(spec, _db(r), nbytes) for spec, nbytes, r in m.options.values() if spec is not None
    )
    origin = Budget(math.nan, trials, target.describe())
    spec, nbytes, r = m.options[label]
    why = f"allocation: {label}, r {r:.3g}, {nbytes} bytes"
    action = Keep(f"kept float: {why}") if spec is None else Quantize(spec, why)
    return TensorPlan(m.plan.entry, m.plan.decision.then(action, origin))


def _db(r: float) -> float:
    return math.inf if r == 0.0 else -10.0 * math.log10(r)


def _unstorable(measured: Sequence[Measurement], data: Measured) -> str | None:
    """Why the ladder gave no tensor it decides a spec (every one only float: the format
    stores none of its specs for them), shown for the first; None when some tensor has one."""
    if not measured or any(len(m.options) > 1 for m in measured):
        return None
    entry = measured[0].plan.entry
    ladder = budget.candidates(ladder_of(data.options), entry.shape)
    whys = [why for spec in ladder if (why := data.fmt.supports(entry, spec)) is not None]
    shape = list(entry.shape)
    return f"{entry.name} {shape}: {whys[0]}" if whys else f"{entry.name} {shape}"


def _infeasible(
    target: solver.Target, least: float, fixed: int, unstorable: str | None, elements: int
) -> str:
    if unstorable is not None:
        goal = f"predicted KL {target.value:g}" if target.kind == "kl" else target.describe()
        return (
            f"no plan reaches {goal}: the output format stores none of the ladder's specs for "
            f"the tensors it decides ({unstorable}), so every one stays float; give a ladder "
            "with specs these tensors take"
        )
    if target.kind == "kl":
        return (
            f"no plan reaches predicted KL {target.value:g}: the least the ladder reaches is "
            f"{least:.4g}; aim higher or give a ladder with finer specs"
        )
    goal = target.describe()
    if target.kind == "bpw":  # what the bits per weight come to for this model
        allowed = target.bytes_for(elements)
        goal += f" = {solver.human_bytes(allowed)} for its {elements} weights"
    return (
        f"no plan fits {goal}: the smallest the ladder makes is "
        f"{solver.human_bytes(least + fixed)}, {fixed} bytes of it in tensors the ladder does "
        "not decide; aim higher or give a ladder with smaller specs"
    )


# ---- files that reproduce the plan ------------------------------------------------------------


def recipe_text(
    plans: Sequence[TensorPlan],
    target: solver.Target,
    imatrix: Path | None = None,
    weighs_codes: bool = True,
) -> str:
    """A recipe (TOML) whose rules pin each tensor the allocation decided to its spec (or keep
    it): quantize --recipe FILE with the same input and format writes the same plan (with an
    importance matrix that weighed each spec's range search, only given it again)."""
    lines = [
        f"# qtool allocation ({target.describe()}): one rule per tensor it decided.",
        "# quantize INPUT --recipe THIS_FILE with the same --format (GGUF: any --dtype, which",
        "# the rules override) writes the same plan.",
    ]
    if imatrix is not None and weighs_codes:
        lines += [
            f"# Made with --imatrix {_comment_safe(imatrix.name)}: the same bytes need that",
            "# --imatrix again (it weighs each spec's range search; the rules pin only the specs).",
        ]
    elif imatrix is not None:
        lines += [
            f"# Planned with --imatrix {_comment_safe(imatrix.name)} --imatrix-use plan: the codes",
            "# are unweighted, so this recipe alone (no --imatrix) writes the same tensors.",
        ]
    lines.append("")
    for p in plans:
        if not p.decision.budget:
            continue
        lines.append("[[rule]]")
        lines.append(f"match = {_toml_str(exact_pattern(p.entry.name))}")
        spec = p.spec
        if spec is None:
            lines.append('keep = "allocation: float"')
        elif isinstance(spec, QSpec):
            lines += _grid_keys(spec)
        else:
            lines.append(f"dtype = {_toml_str(spec_label(spec))}")
        lines.append("")
    return "\n".join(lines)


def _grid_keys(spec: QSpec) -> list[str]:
    from qtool.spec import PerChannel, PerGroup

    g = spec.granularity
    keys = [f'scheme = "{spec.scheme.value}"', f'dtype = "{spec.dtype.value}"']
    if isinstance(g, PerGroup):
        keys += ['granularity = "group"', f"group_size = {g.size}"]
    elif isinstance(g, PerChannel):
        keys += ['granularity = "channel"', f"axis = {g.axis}"]
    else:
        keys.append('granularity = "tensor"')
    keys.append(f'range = "{spec.range_method.value}"')
    return keys


def _comment_safe(text: str) -> str:
    """`text` on one TOML comment line: control characters shown as `?`."""
    return "".join("?" if ch < " " or ch == "\x7f" else ch for ch in text)


def exact_pattern(name: str) -> str:
    """A recipe pattern matching `name` alone: the name itself, or where it holds a glob
    wildcard (or starts with `re:`) the escaped name after `re:`."""
    import re

    from qtool.recipe.rules import is_wildcard

    pattern = name.startswith("re:") or is_wildcard(name)
    return f"re:{re.escape(name)}" if pattern else name


def _toml_str(text: str) -> str:
    """A TOML basic string: quote, backslash and every control character escaped."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch < " " or ch == "\x7f":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def llama_pattern(name: str) -> str | None:
    """`^name$` as llama-quantize reads it from a --tensor-type-file: whitespace-separated, cut
    at the first `=`, lowercased, then std::regex-searched in the unchanged name. Letters other
    than lowercase, `=`, and every other ASCII character but `.`, `_` and digits are written as
    \\xHH (which lowercasing keeps); None for a name it cannot express (non-ASCII, NUL)."""
    if not name.isascii() or "\0" in name:
        return None
    out = []
    for ch in name:
        if ch.isdigit() or ch == "_" or "a" <= ch <= "z":
            out.append(ch)
        elif ch == ".":
            out.append("\\.")
        else:
            out.append(f"\\x{ord(ch):02x}")
    return "^" + "".join(out) + "$"


def tensor_type_text(plans: Sequence[TensorPlan], gguf_name: Mapping[str, str]) -> str:
    """llama-quantize's --tensor-type-file: `^name$=type` per tensor the allocation decided,
    name as the GGUF file holds it (llama_pattern: anchored, escaped; llama.cpp takes each as a
    regex_search, the first match wins), type lowercase. The names were checked before the run
    (inexpressible_name)."""
    out = []
    for p in plans:
        if not p.decision.budget:
            continue
        pattern = llama_pattern(gguf_name.get(p.entry.name, p.entry.name))
        assert pattern is not None  # inexpressible_name refused it before the run
        kind = spec_label(p.spec) if p.spec is not None else p.entry.dtype
        out.append(f"{pattern}={kind.lower()}")
    return "\n".join(out) + "\n"


def inexpressible_name(plans: Sequence[TensorPlan], fmt: OutputFormat) -> str | None:
    """The first tensor the allocation may decide whose GGUF name a --tensor-type-file cannot
    express (llama_pattern), or None."""
    names = gguf_names(plans, fmt)
    for p in plans:
        name = names.get(p.entry.name, p.entry.name)
        if p.decision.budget and llama_pattern(name) is None:
            return name
    return None


def save_plan(plans: Sequence[TensorPlan], options: QuantizeOptions, fmt: OutputFormat) -> None:
    """The plan's recipe and llama-quantize tensor types where the options ask for them, written
    together through atomic.OutputSet (temp beside each, never through a link, renamed into
    place when both are written). Called once the run's own outputs are committed: a run that
    fails leaves no plan of an output that does not exist; the paths passed the run's output
    checks with -o (layout.py)."""
    from qtool.io.atomic import OutputSet, remove_stale_temps

    assert options.allocation is not None
    texts: list[tuple[Path, str]] = []
    if options.save_recipe is not None:
        weighs = options.imatrix_weighs_codes
        recipe = recipe_text(plans, options.allocation, options.imatrix, weighs)
        texts.append((options.save_recipe, recipe))
    if options.save_tensor_types is not None:
        texts.append((options.save_tensor_types, tensor_type_text(plans, gguf_names(plans, fmt))))
    for directory in {path.parent for path, _ in texts}:
        remove_stale_temps(directory)
    with OutputSet() as outputs:
        for path, text in texts:
            outputs.create(path).write(text.encode("utf-8"))
        outputs.commit()


def gguf_names(plans: Sequence[TensorPlan], fmt: OutputFormat) -> dict[str, str]:
    """Each tensor's name in the GGUF the format writes (its own where it renames none)."""
    rename = getattr(fmt, "gguf_name", None)
    if rename is None:
        return {}
    return {p.entry.name: rename(p.entry.name) for p in plans}
