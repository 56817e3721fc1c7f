"""Per-tensor recipes: ordered rules that map tensor names to a spec or to "keep in float".

Torch-free, so a dry run plans from headers alone. The rules a tensor meets, in order (the
first whose pattern matches its name decides):

1. `--exclude GLOB` rules: keep the tensor ("excluded by --exclude 'GLOB'");
2. the recipe's `[[rule]]` tables, in file order;
3. `--include GLOB` rules: the command-line spec, and 0-d/1-D float tensors are selected too
   (quantized per tensor);
4. no rule matched: with `--include` given, keep ("not matched by --include"); without, the
   default selection (float tensors of 2+ dims) with the command-line spec.

A pattern is an fnmatch glob on the whole name (case-sensitive; `*` crosses dots) or, after
`re:`, a regular expression that must match the whole name (re.fullmatch). A rule's spec keys
override the command-line spec field by field: a rule that says only `dtype = "int4"` keeps the
command-line scheme, granularity and range method. Granularity, axis and group size count as
one field: a rule naming any of them sets the whole granularity (`granularity = "channel"`
alone means axis 0). Integer, bool, empty and 0-d/1-D tensors a recipe rule matches stay as
they are, with the usual reason (only `--include` quantizes 0-d/1-D tensors).
"""

from __future__ import annotations

import enum
import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from qtool import patterns
from qtool.dtypes import FLOAT_DTYPES
from qtool.errors import InputError, RecipeError
from qtool.spec import QSpec, SpecPatch, fit_spec


class Entry(Protocol):
    """What resolving needs of a tensor (qtool.io.stformat.TensorEntry has it)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class Keep:
    """Leave the tensor as it is, byte for byte, for `reason`."""

    reason: str


class RuleKind(str, enum.Enum):
    """Where a rule comes from."""

    RECIPE = "recipe"
    EXCLUDE = "--exclude"
    INCLUDE = "--include"


@dataclass(frozen=True)
class Rule:
    """`pattern` -> `action`; `number` counts from 1 within its source (the recipe file, or
    the --include / --exclude flags in command-line order); `line` is 0 off a file."""

    number: int
    pattern: str
    action: SpecPatch | Keep
    line: int = 0
    kind: RuleKind = RuleKind.RECIPE
    file: str | None = None

    def matches(self, name: str) -> bool:
        """Glob on the whole name, or `re:` + a regular expression matching the whole name."""
        if self.pattern.startswith("re:"):  # bounded: a recipe's pattern cannot hang qtool
            try:
                return patterns.matches(self.pattern[3:], name, full=True)
            except patterns.PatternError as err:
                raise RecipeError(self.file, f"line {self.line}: {err}") from None
        return fnmatch.fnmatchcase(name, self.pattern)

    def describe(self) -> str:
        """Label for tables: rule 3 'mlp.*', or --exclude 'embed.*'."""
        if self.kind is RuleKind.RECIPE:
            return f"rule {self.number} '{self.pattern}'"
        return f"{self.kind.value} '{self.pattern}'"


@dataclass(frozen=True)
class Recipe:
    """A loaded recipe file: its rules in order and its budget ladder (None: the default)."""

    path: str
    rules: tuple[Rule, ...]
    ladder: tuple[QSpec, ...] | None = None


@dataclass(frozen=True)
class Resolution:
    """One tensor's fate: the rule that decided it (None: no rule matched) and the spec as it
    applies to this tensor, or Keep; `note` says how the spec was fitted to the tensor."""

    rule: Rule | None
    action: QSpec | Keep
    note: str = ""
    asked: QSpec | None = None
    """The spec as the rule (or the command line) gave it, before it was fitted to the tensor."""
    by_rule: bool = False
    """The rule's own decision (its keep or its spec; --include matching nothing counts), not
    the default selection nor a tensor the rule could not quantize (1-D, integer)."""

    @property
    def spec(self) -> QSpec | None:
        return self.action if isinstance(self.action, QSpec) else None

    @property
    def from_command_line(self) -> bool:
        """Quantized with the command-line spec (no recipe rule chose it): the tensors an
        error budget (--target-sqnr) decides."""
        return self.spec is not None and (self.rule is None or self.rule.kind is RuleKind.INCLUDE)


# -- resolving ------------------------------------------------------------------------------


def rules_from_cli(
    include: Iterable[str], exclude: Iterable[str], recipe_rules: Iterable[Rule] = ()
) -> tuple[Rule, ...]:
    """Every rule in the order they are tried: --exclude, the recipe's, then --include."""
    excluded = [
        Rule(n, p, Keep(f"excluded by --exclude '{p}'"), kind=RuleKind.EXCLUDE)
        for n, p in enumerate(exclude, 1)
    ]
    included = [Rule(n, p, SpecPatch(), kind=RuleKind.INCLUDE) for n, p in enumerate(include, 1)]
    return (*excluded, *recipe_rules, *included)


def resolve(
    rules: tuple[Rule, ...], entry: Entry, base: QSpec, *, checkpoint: Path | str | None = None
) -> Resolution:
    """What happens to `entry` (first matching rule wins; see the module docstring).
    RecipeError / InputError (naming `checkpoint`) for an axis the tensor lacks."""
    rule = next((r for r in rules if r.matches(entry.name)), None)
    if rule is None and any(r.kind is RuleKind.INCLUDE for r in rules):
        return Resolution(None, Keep("not matched by --include"), by_rule=True)
    action = rule.action if rule is not None else SpecPatch()
    if isinstance(action, Keep):
        return Resolution(rule, action, by_rule=True)
    reason = selection_reason(entry, small=rule is not None and rule.kind is RuleKind.INCLUDE)
    if reason is not None:
        return Resolution(rule, Keep(reason))
    asked = action.apply(base)
    try:
        fitted, note = fit_spec(asked, entry.shape)
    except ValueError as err:
        raise _axis_error(rule, entry, str(err), checkpoint) from None
    return Resolution(rule, fitted, note, asked, by_rule=rule is not None)


def selection_reason(entry: Entry, *, small: bool = False) -> str | None:
    """Why a tensor cannot be quantized, or (unless `small`) is not by default; None if it is."""
    if entry.dtype not in FLOAT_DTYPES:
        return _non_float_reason(entry.dtype)
    if 0 in entry.shape:
        return "empty tensor"
    if len(entry.shape) < 2 and not small:
        return "0-d scalar" if not entry.shape else "1-D (bias/norm)"
    return None


def unmatched(rules: Iterable[Rule], names: Iterable[str]) -> list[Rule]:
    """The rules whose pattern matches none of `names` (each worth a one-line warning)."""
    names = list(names)
    with patterns.bounded():  # one time budget for the recipe's patterns over every name
        return [r for r in rules if not any(r.matches(n) for n in names)]


def _axis_error(
    rule: Rule | None, entry: Entry, message: str, checkpoint: Path | str | None
) -> InputError | RecipeError:
    if rule is not None and rule.kind is RuleKind.RECIPE:
        return RecipeError(
            rule.file,
            f"line {rule.line}: {rule.describe()}: {message}; narrow its match or change its axis",
            entry.name,
        )
    return InputError(
        checkpoint, f"{message} or exclude the tensor", entry.name, hint=("axis", "exclude")
    )


def _non_float_reason(dtype: str) -> str:
    if dtype == "BOOL":
        return "bool tensor"
    if dtype.startswith(("I", "U")):
        return "integer tensor"
    if dtype.startswith(("F8", "F4", "F6")):
        return f"already low-precision ({dtype})"
    return f"not a real float tensor ({dtype})"
