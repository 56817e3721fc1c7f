"""A tensor's fate as a value: what happens to it (the action) and what decided it (the origin).

    Decision(Quantize(int4 g128), Budget(24 dB, trials))            the budget chose int4 g128
      superseded: Decision(Quantize(int8 channel), Budget(24 dB))   it was left to the budget
        superseded: Decision(Quantize(int8 channel), Selection())   by the default selection

Each planning pass (engine/plan.py lists them in order) may give a tensor a new decision; the
decision it replaces stays as `superseded`, so a table can say "budget chose int4 g128; aligned
with its fused siblings". A pass that leaves the action as it was leaves the decision as it was.
No pass edits a decision or flips a flag on it; everything a report or a format asks of a plan
(TensorPlan) is read from its decision (`report()` gives the reports' DecidedBy). Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from qtool.engine.sizes import Stored, qparam_nbytes, stored_dtype, stored_nbytes
from qtool.io.stformat import TensorEntry
from qtool.recipe.rules import Keep as Keep  # the decision's keep: a rule's, or any pass's
from qtool.recipe.rules import Rule, RuleKind
from qtool.results import DecidedBy, RuleRef, Trial
from qtool.spec import Codec, spec_label

# -- actions: Keep(reason) (a recipe rule's keep is the same value), or Quantize -----------


@dataclass(frozen=True)
class Quantize:
    """Quantize the tensor with `spec` (fitted to its shape). `note` says how the spec was
    adapted to the tensor or why it was chosen; `asked` is the spec before it was fitted (a
    format may take that one instead); `stored` is the format's storage (None: qtool's codes and
    sidecar), which does not count in comparing actions."""

    spec: Codec
    note: str = ""
    asked: Codec | None = None
    stored: Stored | None = field(default=None, compare=False)


Action = Keep | Quantize


@dataclass(frozen=True)
class Step:
    """An action as reports show it, before its origin adds what decided it."""

    action: str
    spec: Codec | None
    reason: str
    history: tuple[DecidedBy, ...] = ()

    @classmethod
    def of(cls, action: Action, history: tuple[DecidedBy, ...]) -> Step:
        if isinstance(action, Quantize):
            return cls("quantize", action.spec, action.note, history)
        return cls("keep", None, action.reason, history)

    def head(self, origin: str) -> tuple[str, str, Codec | None, str]:
        """DecidedBy's first fields: action, origin, spec, reason."""
        return self.action, origin, self.spec, self.reason


# -- origins -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """The rules (--exclude, a recipe's, --include, first match wins) and the default selection
    (float tensors of 2+ dims). `rule`: the rule whose pattern matched (None: none did);
    `by_name`: the rule's own decision, or --include matching nothing (False: the default
    selection, or a tensor whose kind the matched rule cannot quantize: integer, 1-D, empty);
    `labelled`: tables name the rule (only with a recipe, so plain runs keep their text)."""

    rule: Rule | None = None
    by_name: bool = False
    labelled: bool = False

    def describe(self) -> str:
        if self.rule is None:
            return "not matched by --include" if self.by_name else "default selection"
        where = f" ({self.rule.file}: line {self.rule.line})" if self.rule.file else ""
        return self.rule.describe() + where

    def step(self, act: Step) -> DecidedBy:
        rule = self.rule
        if rule is None:
            return DecidedBy(*act.head("not-included" if self.by_name else "default"), act.history)
        source = _RULE_SOURCES[rule.kind]
        ref = RuleRef(source, rule.number, rule.pattern, rule.file, rule.line)
        return DecidedBy(*act.head(source), act.history, rule=ref)


_RULE_SOURCES = {
    RuleKind.RECIPE: "recipe",
    RuleKind.EXCLUDE: "exclude",
    RuleKind.INCLUDE: "include",
}


@dataclass(frozen=True)
class Budget:
    """The error budget (--target-sqnr): the cheapest ladder spec reaching `target_db`, with
    every candidate tried (no trials: the tensor is the budget's to decide, not yet measured).
    `allocation`: the target of an allocation (engine/allocate.py) instead, target_db NaN."""

    target_db: float
    trials: tuple[Trial, ...] = ()
    allocation: str | None = None

    def describe(self) -> str:
        if self.allocation is not None:
            if not self.trials:
                return f"left to the allocation ({self.allocation})"
            return f"allocation {self.allocation} after {len(self.trials)} trial(s)"
        if not self.trials:
            return f"left to the budget ({self.target_db:g} dB)"
        return f"budget {self.target_db:g} dB after {len(self.trials)} trial(s)"

    def step(self, act: Step) -> DecidedBy:
        head = act.head("budget")
        db = None if self.allocation is not None else self.target_db
        return DecidedBy(*head, act.history, target_sqnr_db=db, trials=self.trials)


@dataclass(frozen=True)
class FusedSiblings:
    """Aligned with the siblings a consumer fuses (`key` names the set): they share one spec."""

    key: str

    def describe(self) -> str:
        return f"aligned with its fused siblings {self.key}"

    def step(self, act: Step) -> DecidedBy:
        return DecidedBy(*act.head("fused-siblings"), act.history, fused=self.key)


@dataclass(frozen=True)
class FormatConstraint:
    """The output format's own decision (what it can store, which tensors it quantizes)."""

    format: str

    def describe(self) -> str:
        return f"{self.format} format"

    def step(self, act: Step) -> DecidedBy:
        return DecidedBy(*act.head("format"), act.history, format=self.format)


@dataclass(frozen=True)
class NonFiniteGuard:
    """--keep-nonfinite: the tensor holds `count` NaN/Inf values, which have no code."""

    count: int

    def describe(self) -> str:
        return f"{self.count} NaN/Inf values (--keep-nonfinite)"

    def step(self, act: Step) -> DecidedBy:
        return DecidedBy(*act.head("keep-nonfinite"), act.history, nonfinite=self.count)


@dataclass(frozen=True)
class Calibrated:
    """A calibrated method's pass (engine/methods): `method` produced the codes (gptq, or rtn
    where the guard kept round to nearest); the action's note says why."""

    method: str

    def describe(self) -> str:
        return f"calibrated: {self.method}"

    def step(self, act: Step) -> DecidedBy:
        return DecidedBy(*act.head("calibrated"), act.history, method=self.method)


Origin = Selection | Budget | FusedSiblings | FormatConstraint | NonFiniteGuard | Calibrated


# -- the decision ------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """What happens to a tensor and what decided it; `superseded` is the decision it replaced."""

    action: Action
    origin: Origin
    superseded: Decision | None = None

    def then(self, action: Action, origin: Origin) -> Decision:
        """This decision followed by a pass's: itself when the action is unchanged (only the
        format's storage refreshed), else `action` by `origin`, superseding this one."""
        if action != self.action:
            return Decision(action, origin, self)
        return Decision(action, self.origin, self.superseded)

    @property
    def history(self) -> Iterator[Decision]:
        """This decision, then each it superseded, back to the rules'."""
        d: Decision | None = self
        while d is not None:
            yield d
            d = d.superseded

    @property
    def selection(self) -> Selection:
        """The first decision's origin: the rules and the default selection."""
        *_, first = self.history
        assert isinstance(first.origin, Selection)
        return first.origin

    @property
    def budget(self) -> bool:
        """The error budget decides this tensor: it claimed it, chose for it or aligned it, and
        no later pass took it away (a format keeping it, the non-finite guard)."""
        origin = self.origin
        if isinstance(origin, Budget | FusedSiblings):
            return True
        if isinstance(origin, FormatConstraint) and self.superseded is not None:
            newly_kept = isinstance(self.action, Keep) and isinstance(
                self.superseded.action, Quantize
            )
            return self.superseded.budget and not newly_kept
        return False

    def describe(self) -> str:
        """Why, oldest decision first: 'default selection: int8 channel; left to the budget
        (24 dB): int8 channel; budget 24 dB after 2 trial(s): int4 g128 mse'."""
        steps = reversed(list(self.history))
        return "; ".join(f"{d.origin.describe()}: {_label(d.action)}" for d in steps)

    def report(self) -> DecidedBy:
        """The decision as reports show it: this one, with the ones it superseded (oldest
        first) as its history (built with constructors only: 50,000 rows ask)."""
        earlier = () if self.superseded is None else tuple(self.superseded._oldest_first())
        return self.origin.step(Step.of(self.action, earlier))

    def _oldest_first(self) -> list[DecidedBy]:
        steps = [] if self.superseded is None else self.superseded._oldest_first()
        return [*steps, self.origin.step(Step.of(self.action, ()))]

    # -- what the reports and the formats read of it (formats.base.Ruling) ----------------

    @property
    def spec(self) -> Codec | None:
        """The spec it is quantized with (None: kept)."""
        return self.action.spec if isinstance(self.action, Quantize) else None

    @property
    def reason(self) -> str:
        """Why it is kept ("" when quantized)."""
        return self.action.reason if isinstance(self.action, Keep) else ""

    @property
    def note(self) -> str:
        """How the spec was adapted to the tensor or why it was chosen ("" when kept)."""
        return self.action.note if isinstance(self.action, Quantize) else ""

    @property
    def asked(self) -> Codec | None:
        """The spec before it was fitted to the tensor (None: as `spec`, or kept)."""
        return self.action.asked if isinstance(self.action, Quantize) else None

    @property
    def stored(self) -> Stored | None:
        return self.action.stored if isinstance(self.action, Quantize) else None

    @property
    def by_name(self) -> bool:
        """A rule decided by name (an --exclude, a recipe rule or an --include, or --include
        matching nothing); False for the default selection."""
        return self.selection.by_name

    @property
    def rule_label(self) -> str:
        """The rule that decided, as tables name it ("rule 3 'mlp.*'"; "" without a recipe)."""
        selection = self.selection
        return selection.rule.describe() if selection.labelled and selection.rule else ""

    @property
    def rule_origin(self) -> str:
        """Where a recipe rule is written ("llm.toml: line 12: "; "" for others)."""
        rule = self.selection.rule
        if rule is None or rule.kind is not RuleKind.RECIPE:
            return ""
        return f"{rule.file}: line {rule.line}: "

    @property
    def spec_chosen(self) -> bool:
        """A recipe rule or the error budget chose the spec, not the command line."""
        if self.spec is None:
            return False
        rule = self.selection.rule
        by_recipe = rule is not None and rule.kind is RuleKind.RECIPE
        return by_recipe or any(isinstance(d.origin, Budget) for d in self.history)


def _label(action: Action) -> str:
    return spec_label(action.spec) if isinstance(action, Quantize) else f"kept ({action.reason})"


@dataclass(frozen=True)
class TensorPlan:
    """One tensor and its decision; what it is and why is read from the decision (the formats
    read it through formats.base.Ruled), how many bytes it takes from both."""

    entry: TensorEntry
    decision: Decision

    @property
    def spec(self) -> Codec | None:
        return self.decision.spec

    @property
    def out_dtype(self) -> str:
        return stored_dtype(self.entry, self.spec, self.decision.stored)

    @property
    def out_nbytes(self) -> int:
        """Bytes of the tensor in the output file: its codes, or the tensor as it is."""
        return stored_nbytes(self.entry, self.spec, self.decision.stored)

    @property
    def qparam_nbytes(self) -> int:
        return qparam_nbytes(self.entry, self.spec, self.decision.stored)
