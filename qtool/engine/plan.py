"""The plan: every tensor's Decision (engine/decision.py), built by passes in this order.

From the headers alone (torch-free, so a dry run is instant), `plan_headers`:
  1. rules     --exclude, the recipe's rules, --include (first match wins; recipe/rules.py),
               else the default selection: float tensors of 2+ dims get the command-line spec,
               1-D tensors, scalars, empty and non-float tensors are kept, and so is an input
               embedding tied to the output head at 4 bits (engine/tied.py; the qtool format,
               as compressed-tensors keeps every embedding). The spec is fitted to the
               tensor's shape (spec.fit_spec: a group as long as a row is per channel).
  2. budget    with --target-sqnr, the tensors the command line would quantize become the
               budget's to decide (holding int8 per channel until it has).
  3. format    the output format's constraints (formats.base.OutputFormat.select: which
               tensors it can store, how; compressed-tensors quantizes Linear weights only).
Reading the tensors, `plan_data` (after the run has checked its outputs):
  4. budget    the cheapest ladder spec reaching the target, measured (engine/budget.py).
  5. fused     siblings a consumer fuses (q/k/v) aligned on one spec (engine/budget.py).
  6. format    the format's constraints again, on the specs the budget chose.
  7. guard     --keep-nonfinite: tensors holding NaN/Inf are kept (engine/nonfinite.py).
Each pass may supersede a decision, never edit one; the table, the JSON and the dry run print
the final decision (`planned_row`).
"""

from __future__ import annotations

import fnmatch
import functools
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from qtool import patterns
from qtool.calibration import Calibration, TextUse
from qtool.engine.decision import (
    Action,
    Budget,
    Decision,
    FormatConstraint,
    Keep,
    Quantize,
    Selection,
    TensorPlan,
)
from qtool.engine.sizes import Stored
from qtool.errors import InputError, RecipeError, UsageError
from qtool.formats.base import Choice, OutputFormat
from qtool.formats.registry import refuses
from qtool.io.atomic import resolve_output
from qtool.io.stformat import TensorEntry
from qtool.recipe.rules import Recipe, Rule, RuleKind, resolve, rules_from_cli
from qtool.results import AllocationPlan, ErrorStats, ModelKL, QuantizeRow
from qtool.spec import (
    INT8_CHANNEL,
    Codec,
    FormatName,
    GroupFallback,
    QSpec,
    SpecPatch,
    fit_spec,
)

if TYPE_CHECKING:
    from qtool.numerics.allocate import Target


@dataclass(frozen=True)
class QuantizeOptions:
    """What a quantize run does to the tensors (how the run goes is engine.run.RunOptions)."""

    spec: Codec = QSpec()
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    keep_nonfinite: bool = False  # keep NaN/Inf tensors unquantized instead of failing
    recipe: Recipe | None = None  # per-tensor rules, tried after --exclude, before --include
    target_sqnr: float | None = None  # error budget for the tensors no recipe rule fixed
    allocation: Target | None = None  # or a size/bpw/KL target for them (engine/allocate.py)
    save_recipe: Path | None = None  # the allocation's plan as a recipe that reproduces it
    save_tensor_types: Path | None = None  # and as llama-quantize's --tensor-type-file
    format: FormatName = FormatName.QTOOL  # the output format
    config: Path | None = None  # the model's config.json, for a single-file model export
    group_fallback: GroupFallback = GroupFallback.ERROR  # K not a multiple of G
    imatrix: Path | None = None  # an importance matrix weighing the range search (importance.py)
    imatrix_weighs_codes: bool = True  # False: it guides only an allocation, the codes unweighted
    calibration: Calibration | None = None  # a calibrated method (engine/methods), its data

    def __post_init__(self) -> None:
        # the names as plain strings too ("compressed-tensors"), as a library caller writes them
        object.__setattr__(self, "format", FormatName(self.format))
        object.__setattr__(self, "group_fallback", GroupFallback(self.group_fallback))
        if not self.imatrix_weighs_codes and (self.imatrix is None or self.allocation is None):
            raise UsageError(
                None, "an imatrix that weighs no code only guides an allocation: give the "
                "imatrix and a size, bpw or KL target", hint="imatrix-use",
            )  # fmt: skip

    @functools.cached_property
    def rules(self) -> tuple[Rule, ...]:
        """Every rule in the order tried: --exclude, the recipe's, --include (one tuple, so
        its matcher is built once: recipe/rules.py)."""
        recipe_rules = self.recipe.rules if self.recipe is not None else ()
        return rules_from_cli(self.include, self.exclude, recipe_rules)

    @property
    def budgeted(self) -> bool:
        """The tensors no rule fixed are left to the error budget or the allocation."""
        return self.target_sqnr is not None or self.allocation is not None

    @property
    def input_files(self) -> tuple[Path, ...]:
        """The files the run reads besides the checkpoint (the imatrix, the recipe, a method's
        calibration and check texts): inputs no output may replace, like the checkpoint's own."""
        cal = self.calibration
        texts = (*cal.texts, *cal.check_texts) if cal is not None else ()
        recipe = (Path(self.recipe.path),) if self.recipe is not None else ()
        return (*((self.imatrix,) if self.imatrix is not None else ()), *recipe, *texts)


@dataclass(frozen=True)
class ModelPlan:
    """Every tensor's plan, in shard order and file order within a shard."""

    shards: tuple[Path, ...]
    plans: tuple[TensorPlan, ...]
    counts: tuple[int, ...]  # how many of the plans each shard holds
    notes: tuple[str, ...] = ()  # what a data pass has to say (a calibration text too short)
    texts: tuple[TextUse, ...] = ()  # the texts a method or an imatrix used (the outputs say)
    model_kl: tuple[ModelKL, ...] = ()  # a calibrated method's model-level figures
    allocation: AllocationPlan | None = None  # an allocation target's plan (engine/allocate.py)

    def per_shard(self) -> Iterator[tuple[Path, list[TensorPlan]]]:
        start = 0
        for shard, count in zip(self.shards, self.counts, strict=True):
            yield shard, list(self.plans[start : start + count])
            start += count

    def of(self, shard: Path) -> list[TensorPlan]:
        return next(plans for s, plans in self.per_shard() if s == shard)

    def with_plans(self, plans: Iterable[TensorPlan]) -> ModelPlan:
        """The same shards with new plans, in the same order."""
        new = tuple(plans)
        assert [p.entry for p in new] == [p.entry for p in self.plans]
        return replace(self, plans=new)


class DataPasses(Protocol):
    """The passes that read the tensors or price specs with the kernels (engine/budget.py)."""

    def choose(self, plan: ModelPlan) -> ModelPlan:
        """Pass 4: the budget's choice for each tensor it decides."""

    def align(self, plans: tuple[TensorPlan, ...]) -> list[TensorPlan]:
        """Pass 5: fused siblings on one spec."""

    def guard(self, plan: ModelPlan) -> ModelPlan:
        """Pass 7: tensors holding NaN/Inf kept as they are (--keep-nonfinite)."""


def plan_headers(
    headers: Iterable[tuple[Path, tuple[TensorEntry, ...]]],
    options: QuantizeOptions,
    fmt: OutputFormat,
    tied: frozenset[str] = frozenset(),
) -> ModelPlan:
    """Passes 1 to 3 over every shard's tensors (from their headers): the plan a dry run shows.
    `tied`: the input embeddings that are also the output head (engine/tied.py). InputError for
    an axis a tensor lacks; the format's own errors (a spec it cannot store)."""
    shards, plans, counts = [], [], []
    kept_tied = tied if fmt.keeps_tied_embedding else frozenset()
    with patterns.bounded():  # one time budget for the recipe's patterns over every tensor
        for shard, entries in headers:
            shards.append(shard)
            counts.append(len(entries))
            plans += plan_tensors(shard, entries, options, kept_tied)  # passes 1 and 2
    _refuse_whole_codecs(plans, fmt)
    return ModelPlan(tuple(shards), tuple(by_format(plans, fmt)), tuple(counts))  # pass 3


def _refuse_whole_codecs(plans: list[TensorPlan], fmt: OutputFormat) -> None:
    """A recipe rule naming a whole codec (a GGUF type, "Q6_K") is an error unless the format
    stores it (Codec.whole; a grid the format cannot store is the format's to refuse)."""
    for p in plans:
        spec = p.spec
        if spec is None or not spec.whole:
            continue
        why = refuses(fmt.name, spec)
        if why is not None:
            where = (
                f"{p.decision.rule_origin}{p.decision.rule_label}: "
                if p.decision.rule_origin
                else ""
            )
            raise RecipeError(None, where + why, p.entry.name)


def plan_data(
    plan: ModelPlan, options: QuantizeOptions, fmt: OutputFormat, data: DataPasses
) -> ModelPlan:
    """Passes 4 to 7, which read the tensors (only those that have anything to do)."""
    if options.budgeted:
        plan = data.choose(plan)
        plan = plan.with_plans(data.align(plan.plans))
        plan = plan.with_plans(by_format(plan.plans, fmt))
    if options.keep_nonfinite:
        plan = data.guard(plan)
    return plan


def plan_tensors(
    path: Path | str,
    entries: tuple[TensorEntry, ...],
    options: QuantizeOptions,
    tied: frozenset[str] = frozenset(),
) -> list[TensorPlan]:
    """Passes 1 (rules; `tied`: the embeddings the default selection keeps at 4 bits) and 2
    (the budget's tensors) for the tensors of one file, in order; InputError (naming `path`)
    or RecipeError for an axis a tensor lacks."""
    return [TensorPlan(e, _claimed(_by_rules(path, e, options, tied), e, options)) for e in entries]


TIED_KEPT = "tied to the output head (float at 4 bits)"


def _by_rules(
    path: Path | str, entry: TensorEntry, options: QuantizeOptions, tied: frozenset[str]
) -> Decision:
    found = resolve(options.rules, entry, options.spec, checkpoint=path)
    selection = Selection(found.rule, found.by_rule, labelled=options.recipe is not None)
    if isinstance(found.action, Keep):
        return Decision(found.action, selection)
    by_default = found.rule is None and not found.by_rule
    if by_default and entry.name in tied and found.action.nibbles:
        return Decision(Keep(TIED_KEPT), selection)
    return Decision(Quantize(found.action, found.note, found.asked), selection)


def tied_warnings(
    plans: Iterable[TensorPlan], tied: frozenset[str], measured: bool = False
) -> list[str]:
    """One line per embedding tied to the output head that a rule or the budget quantized to
    4 bits, the costliest place for them; not one an allocation chose by its measured
    sensitivity (`measured`), which weighed that cost (tied_notes says so)."""
    return [
        f"{p.entry.name} is also the output head (tied embeddings) and is quantized to 4 bits "
        f"({spec.describe()}), which costs the most quality of any tensor; keep it float or "
        "at 8 bits"
        for p, spec in _tied_4bit(plans, tied)
        if not (measured and _allocated(p))
    ]  # fmt: skip


def tied_notes(plans: Iterable[TensorPlan], tied: frozenset[str], measured: bool) -> list[str]:
    """One line per embedding tied to the output head that an allocation with sensitivities
    (`measured`) quantized to 4 bits: its alpha is the KL the model loses, head included."""
    if not measured:
        return []
    return [
        f"{p.entry.name} is also the output head (tied embeddings): the allocation chose "
        f"{spec.describe()} for it by its measured sensitivity (alpha), its KL counted in "
        "the prediction"
        for p, spec in _tied_4bit(plans, tied)
        if _allocated(p)
    ]  # fmt: skip


def _tied_4bit(
    plans: Iterable[TensorPlan], tied: frozenset[str]
) -> Iterator[tuple[TensorPlan, Codec]]:
    for p in plans:
        if p.entry.name in tied and p.spec is not None and p.spec.nibbles:
            yield p, p.spec


def _allocated(plan: TensorPlan) -> bool:
    """An allocation target chose this tensor's spec among its measured candidates."""
    origin = plan.decision.origin
    return isinstance(origin, Budget) and origin.allocation is not None and bool(origin.trials)


def _claimed(decision: Decision, entry: TensorEntry, options: QuantizeOptions) -> Decision:
    """With an error budget, a tensor the command line would quantize is the budget's to
    decide: neither the command-line spec nor a format check applies to it (it holds sym int8
    per channel, which every format stores, until the budget has chosen)."""
    selection = decision.selection
    from_command_line = isinstance(decision.action, Quantize) and (
        selection.rule is None or selection.rule.kind is RuleKind.INCLUDE
    )
    if not options.budgeted or not from_command_line:
        return decision
    spec, _ = fit_spec(INT8_CHANNEL, entry.shape)
    if options.allocation is not None:
        budget = Budget(math.nan, (), options.allocation.describe())
        return Decision(Quantize(spec), budget, decision)
    assert options.target_sqnr is not None
    return Decision(Quantize(spec), Budget(options.target_sqnr), decision)


def by_format(
    plans: list[TensorPlan] | tuple[TensorPlan, ...], fmt: OutputFormat
) -> list[TensorPlan]:
    """Passes 3 and 6: the format's decision over the whole model (all shards at once, so a
    check can span shards); a tensor whose action it leaves alone keeps its decision."""
    choices = fmt.select(plans)
    if choices is None:
        return list(plans)
    origin = FormatConstraint(fmt.name)
    return [
        TensorPlan(p.entry, p.decision.then(_format_action(p, c), origin))
        for p, c in zip(plans, choices, strict=True)
    ]


def _format_action(plan: TensorPlan, choice: Choice) -> Action:
    if choice.spec is None:
        return Keep(choice.reason)
    stored = Stored(choice.nbytes, choice.stored_dtype)
    return Quantize(choice.spec, choice.note, plan.decision.asked, stored)


def planned_row(
    plan: TensorPlan,
    errors: ErrorStats | None = None,
    scale_range: tuple[float, float] | None = None,
) -> QuantizeRow:
    """The table row of a plan, with the error figures and scale range once measured."""
    e = plan.entry
    return QuantizeRow(
        e.name,
        e.shape,
        e.dtype,
        plan.out_dtype,
        plan.spec is not None,
        _detail(plan),
        e.nbytes,
        plan.out_nbytes,
        bytes_qparams=plan.qparam_nbytes,
        errors=errors,
        scale_range=scale_range,
        spec=plan.spec,
        spec_chosen=plan.decision.spec_chosen,
        decided_by=plan.decision.report(),
    )


def _detail(plan: TensorPlan) -> str:
    """The table's words for the decision: 'sym int4 group 128 (64x2 groups) (note) [rule 3
    'mlp.*']', or why it is kept (the budget's reasons say 'kept float: ...' themselves)."""
    decision = plan.decision
    spec = decision.spec
    if spec is None:
        detail = decision.reason if decision.budget else f"kept: {decision.reason}"
    else:
        detail = spec.describe_for(plan.entry.shape)
        if decision.note:
            detail = f"{detail} ({decision.note})"
    rule = decision.rule_label
    if rule and rule not in detail:  # "excluded by --exclude 'x'" names it already
        detail = f"{detail} [{rule}]"
    return detail


def fitted_spec(path: Path, entry: TensorEntry, spec: Codec) -> Codec:
    """The spec as it applies to this tensor (spec.fit_spec); InputError naming `path` and
    the tensor for a channel axis it lacks."""
    try:
        return fit_spec(spec, entry.shape)[0]
    except ValueError as err:
        raise InputError(
            path, f"{err} or exclude the tensor", entry.name, hint=("axis", "exclude")
        ) from None


def unmatched_globs(names: list[str], patterns: tuple[str, ...]) -> list[str]:
    """The patterns that match none of `names` (a typo, or a glob for another model)."""
    return [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]


MIXED_TAG = "quantized"  # the default output name's tag when tensors may differ in dtype


def output_tag(options: QuantizeOptions) -> str:
    """What the default output name says (`model.int8.safetensors`): the storage dtype of every
    tensor the run quantizes, or MIXED_TAG when they may differ (the error budget picks per
    tensor; a recipe rule sets another dtype)."""
    if options.budgeted:
        return MIXED_TAG
    tags = {options.spec.tag}
    for rule in options.rules:
        if isinstance(rule.action, SpecPatch) and rule.action.dtype is not None:
            tags.add(rule.action.dtype.value)
    return options.spec.tag if len(tags) == 1 else MIXED_TAG


def default_quantized_path(src: Path, dtype: str, suffix: str = ".safetensors") -> Path:
    """`model.safetensors` -> `model.int8.safetensors` beside it (`model-F16.gguf` ->
    `model-F16.Q4_K.gguf` with suffix .gguf). A path that does not end in a name (`.`, `..`,
    `m/..`) is the directory it names: `cd m && quantize .` writes `m.int8...` beside `m`."""
    if src.name in ("", ".."):
        src = Path(os.path.abspath(src))  # lexical, as the shell's `..` is
        if not src.name:  # the root: nothing beside it, so the name inside it (refused there)
            src = src / "model"
    return src.with_name(f"{src.stem}.{dtype}{suffix}")


def quantized_output(src: Path, out: Path | None, dtype: str, suffix: str = ".safetensors") -> Path:
    """The quantized file `-o` names: a file of the format's suffix, or the default name in a
    directory."""
    default = default_quantized_path(src, dtype, suffix)
    return resolve_output(out, default, (suffix,), "quantize")
