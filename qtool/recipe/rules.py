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
import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from qtool import patterns
from qtool.dtypes import FLOAT_DTYPES, non_float_reason
from qtool.errors import InputError, RecipeError
from qtool.spec import Codec, SpecPatch, fit_spec


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
        """Glob on the whole name, or `re:` + a regular expression matching the whole name;
        both bounded (patterns.py): a recipe's patterns cannot hang qtool."""
        if self.pattern.startswith("re:"):
            try:
                return patterns.matches(self.pattern[3:], name, full=True)
            except patterns.PatternError as err:
                raise RecipeError(self.file, f"line {self.line}: {err}") from None
        if not is_wildcard(self.pattern):
            return name == self.pattern
        rx = _glob(self.pattern)
        return self._bounded(f"glob {self.pattern!r}", lambda: rx.match(name) is not None, name)

    def any_of(self, names: Iterable[str]) -> bool:
        """Whether the pattern matches any of `names` (bounded as `matches`)."""
        if self.pattern.startswith("re:") or not is_wildcard(self.pattern):
            return any(self.matches(n) for n in names)
        rx = _glob(self.pattern)
        return self._bounded(
            f"glob {self.pattern!r}", lambda: any(rx.match(n) for n in names), "the names"
        )

    def _bounded(self, label: str, work: Callable[[], _T], name: str) -> _T:
        try:
            return patterns.timed(label, work, name)
        except patterns.PatternError as err:
            where = f"line {self.line}: " if self.line else ""
            raise RecipeError(self.file, f"{where}{err}") from None

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
    ladder: tuple[Codec, ...] | None = None


@dataclass(frozen=True)
class Resolution:
    """One tensor's fate: the rule that decided it (None: no rule matched) and the spec as it
    applies to this tensor, or Keep; `note` says how the spec was fitted to the tensor."""

    rule: Rule | None
    action: Codec | Keep
    note: str = ""
    asked: Codec | None = None
    """The spec as the rule (or the command line) gave it, before it was fitted to the tensor."""
    by_rule: bool = False
    """The rule's own decision (its keep or its spec; --include matching nothing counts), not
    the default selection nor a tensor the rule could not quantize (1-D, integer)."""

    @property
    def spec(self) -> Codec | None:
        return self.action if isinstance(self.action, Codec) else None

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
    rules: tuple[Rule, ...], entry: Entry, base: Codec, *, checkpoint: Path | str | None = None
) -> Resolution:
    """What happens to `entry` (first matching rule wins; see the module docstring).
    RecipeError / InputError (naming `checkpoint`) for an axis the tensor lacks."""
    matcher = _matcher(rules)
    rule = matcher.first(entry.name)
    if rule is None and matcher.includes:
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
        return non_float_reason(entry.dtype)
    if 0 in entry.shape:
        return "empty tensor"
    if len(entry.shape) < 2 and not small:
        return "0-d scalar" if not entry.shape else "1-D (bias/norm)"
    return None


def unmatched(rules: Iterable[Rule], names: Iterable[str]) -> list[Rule]:
    """The rules whose pattern matches none of `names` (each worth a one-line warning): the
    rules that decide some name are known from one pass; literal names are looked up; a glob
    whose literal run is in no name is known to match none (one search of all names joined);
    only the rest are tried on every name, within the same time budget."""
    rules, present = tuple(rules), set(names)
    matcher = _matcher(rules)
    joined = "\0".join(present)
    with patterns.bounded():  # one time budget for the recipe's patterns over every name
        deciding = {id(matcher.first(n)) for n in present}
        left = []
        for r in rules:
            if id(r) in deciding:
                continue
            if not _is_pattern(r.pattern):
                matched = r.pattern in present
            elif r.pattern.startswith("re:"):
                matched = r.any_of(present)
            else:  # a run in no name: the glob matches none (a hit may span two names: try)
                found = r._bounded(f"glob {r.pattern!r}", _search(r.pattern, joined), "the names")
                matched = found and r.any_of(present)
            if not matched:
                left.append(r)
        return left


# -- matching many rules against many names ---------------------------------------------------

_T = TypeVar("_T")
_WILDCARD = re.compile(r"[*?\[]")


def is_wildcard(glob: str) -> bool:
    """Whether a glob has a wildcard (`*`, `?`, `[`); without one it matches only itself."""
    return _WILDCARD.search(glob) is not None


def _is_pattern(pattern: str) -> bool:
    return pattern.startswith("re:") or is_wildcard(pattern)


@functools.lru_cache(maxsize=4096)
def _glob(pattern: str) -> re.Pattern[str]:
    return re.compile(fnmatch.translate(pattern))


class _Matcher:
    """The first of `rules` whose pattern matches a name, without trying the globs that cannot
    match it: literal names are one dict; a glob with a literal prefix is tried only on the
    names that begin with it (a dict per prefix length), one that begins with a wildcard only
    on the names that hold its longest literal run (a substring test in C: `*q00001*` is never
    run as a regular expression over a name without `q00001`). The candidates are then tried
    in rule order, each compile and match charged to the bounded() time budget as `re:`
    patterns are. Answers are remembered per name."""

    def __init__(self, rules: tuple[Rule, ...]) -> None:
        self.rules = rules
        self.literal: dict[str, int] = {}
        self.prefixed: dict[str, list[int]] = {}  # literal prefix -> its globs, in order
        self.inner: dict[str, dict[str, list[int]]] = {}  # a literal run's first two
        # characters -> the run -> the globs beginning with a wildcard that hold it
        self.anywhere: list[int] = []  # globs with no literal character (`*`, `?*`)
        self.regexes: list[int] = []  # the `re:` rules, in order
        for i, rule in enumerate(rules):
            p = rule.pattern
            if p.startswith("re:"):
                self.regexes.append(i)
            elif not is_wildcard(p):
                self.literal.setdefault(p, i)
            elif prefix := p[: _WILDCARD.search(p).start()]:  # type: ignore[union-attr]
                self.prefixed.setdefault(prefix, []).append(i)
            elif len(run := _literal_run(p)) >= 2:
                self.inner.setdefault(run[:2], {}).setdefault(run, []).append(i)
            else:
                self.anywhere.append(i)
        self.lengths = sorted({len(prefix) for prefix in self.prefixed})
        self.includes = any(r.kind is RuleKind.INCLUDE for r in rules)
        self.known: dict[str, Rule | None] = {}

    def first(self, name: str) -> Rule | None:
        if name in self.known:
            return self.known[name]
        best = self.literal.get(name, len(self.rules))
        globs: list[int] = []
        if self.prefixed or self.inner or self.anywhere:
            first = self.rules[0]
            globs = first._bounded("the recipe's globs", lambda: self._candidates(name), name)
        for candidates in (globs, self.regexes):
            for i in candidates:
                if i >= best:
                    break
                if self.rules[i].matches(name):
                    best = i
                    break
        rule = self.rules[best] if best < len(self.rules) else None
        self.known[name] = rule
        return rule

    def _candidates(self, name: str) -> list[int]:
        """The globs that may match `name`, in rule order."""
        found = list(self.anywhere)
        for n in self.lengths:
            if n > len(name):
                break
            found += self.prefixed.get(name[:n], ())
        pairs = {name[j : j + 2] for j in range(len(name) - 1)}
        for pair in pairs.intersection(self.inner) if self.inner else ():
            for run, globs in self.inner[pair].items():
                if run in name:
                    found += globs
        return sorted(found)


def _search(glob: str, joined: str) -> Callable[[], bool]:
    """Whether `glob`'s literal run is somewhere in `joined` (all names), as work to time."""
    run = _literal_run(glob)
    return lambda: run in joined


def _literal_run(glob: str) -> str:
    """The longest run of literal characters that every name `glob` matches holds, looked for
    only before its first `[` (what follows may be inside a set); "" when there is none."""
    head = glob.split("[", 1)[0]
    return max(re.split(r"[*?]", head), key=len)


_last: list[tuple[tuple[Rule, ...], _Matcher]] = []


def _matcher(rules: tuple[Rule, ...]) -> _Matcher:
    """The matcher of `rules`, built once for the same tuple (QuantizeOptions keeps its
    rules), so a model's tensors are resolved in one pass."""
    if _last and _last[0][0] is rules:
        return _last[0][1]
    matcher = _Matcher(rules)
    _last[:] = [(rules, matcher)]
    return matcher


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
