"""Recipe files: TOML text -> Recipe, or a RecipeError naming the file, the line and the key.

    ladder = ["int4 g128 mse", { dtype = "int8", granularity = "channel" }]   # optional

    [[rule]]
    match = "*embed_tokens*"           # a glob, or "re:" + a regular expression
    keep = "embeddings stay float"     # either keep = "reason" ...

    [[rule]]
    match = 're:.*\\.mlp\\..*\\.weight'
    dtype = "int4"                     # ... or spec keys: scheme, dtype, granularity,
    group_size = 128                   # axis, group_size, range (see recipe/rules.py)
    range = "mse"

    [[rule]]
    match = "blk.*.ffn_down.weight"
    dtype = "Q6_K"                     # a GGUF block type (--format gguf), alone

Rules may also be written as `rule = [{ match = ..., ... }, ...]`. A ladder entry is a label
("int4 g32 mse", see spec.parse_spec_label) or a table of scheme, dtype, granularity,
group_size and range; its unnamed fields are QSpec's defaults (sym, int8, per channel on axis
0, minmax), not the command line's. A GGUF block type ("Q4_K", for --format gguf) is a label
or a dtype of its own: it takes no other key.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn, TypeVar

import tomllib

from qtool import patterns
from qtool.errors import InputError, RecipeError
from qtool.io.safeopen import read_bounded
from qtool.recipe.rules import Keep, Recipe, Rule, RuleKind, is_wildcard
from qtool.recipe.tomllines import TomlPath, line_of, toml_lines
from qtool.spec import (
    Codec,
    Granularity,
    PerChannel,
    PerGroup,
    PerTensor,
    QSpec,
    RangeMethod,
    Scheme,
    SpecPatch,
    StorageDtype,
    parse_spec_label,
    whole_family,
)

SPEC_KEYS = ("scheme", "dtype", "granularity", "axis", "group_size", "range")
RULE_KEYS = ("match", "keep", *SPEC_KEYS)
LADDER_KEYS = ("scheme", "dtype", "granularity", "group_size", "range")
TOP_KEYS = ("rule", "ladder")
MAX_RECIPE_BYTES = 1 << 20  # a recipe is a page of rules; a bigger file is a wrong path
MAX_PATTERNS = 1_000  # rules matching by glob with a wildcard or re: (docs/reliability.md)
MAX_LADDER = 64  # specs the error budget tries on each tensor (its default ladders hold 4)

_E = TypeVar("_E", Scheme, StorageDtype, RangeMethod)


def load_recipe(path: Path | str) -> Recipe:
    """Read and check a recipe file; RecipeError naming the file, line and key otherwise."""
    try:
        text = read_bounded(path, MAX_RECIPE_BYTES, "the recipe").decode("utf-8-sig")
    except InputError as err:
        raise RecipeError(path, f"cannot read the recipe: {err.message}") from None
    except UnicodeDecodeError:
        raise RecipeError(path, "the recipe is not UTF-8 text") from None
    return parse_recipe(text, str(path))


def parse_recipe(text: str, path: str = "<recipe>") -> Recipe:
    """The recipe in TOML `text` (see docs/recipes.md); `path` names it in errors."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise RecipeError(path, f"not valid TOML: {err}") from None
    except RecursionError:
        raise RecipeError(path, "not valid TOML: nested too deeply") from None
    _check_pattern_count(doc, path)  # before the line map of a huge recipe is built
    check = _Checker(path, toml_lines(text))
    for key in doc:
        if key not in TOP_KEYS:
            check.fail((key,), "unknown key; a recipe holds [[rule]] tables and a ladder")
    tables = doc.get("rule", [])
    if not isinstance(tables, list):
        check.fail(("rule",), "write each rule as a [[rule]] table")
    rules = tuple(check.rule(i, table) for i, table in enumerate(tables))
    ladder = check.ladder(doc["ladder"]) if "ladder" in doc else None
    return Recipe(path, rules, ladder)


def _check_pattern_count(doc: dict[str, object], path: str) -> None:
    """RecipeError for a recipe of more than MAX_PATTERNS globs with a wildcard and `re:`
    patterns (literal names cost one dict lookup whatever their number)."""
    tables = doc.get("rule")
    if not isinstance(tables, list):
        return
    found = [t.get("match") for t in tables if isinstance(t, dict)]
    count = sum(1 for m in found if isinstance(m, str) and (m.startswith("re:") or is_wildcard(m)))
    if count > MAX_PATTERNS:
        raise RecipeError(
            path,
            f"{count:,} rules match by pattern (a glob with * ? [ or re:), over {MAX_PATTERNS:,}: "
            "a recipe is a page of rules; name tensors literally, or merge rules into fewer "
            "patterns",
        )


class _Checker:
    """Turns the parsed TOML into rules, raising RecipeError at the offending line and key."""

    def __init__(self, path: str, lines: dict[TomlPath, int]) -> None:
        self.path, self.lines = path, lines

    def fail(self, where: TomlPath, message: str) -> NoReturn:
        """Raise the error for `where` (("rule", 2, "dtype"): rule 3, key 'dtype')."""
        parts = [f"line {line_of(self.lines, where)}"]
        if len(where) > 1 and isinstance(where[1], int):
            parts.append(f"{'rule' if where[0] == 'rule' else 'ladder entry'} {where[1] + 1}")
            where = where[2:]
        if where:
            parts.append(f"key '{where[0]}'")
        raise RecipeError(self.path, ": ".join([*parts, message]))

    def rule(self, i: int, table: object) -> Rule:
        at: TomlPath = ("rule", i)
        table = self._table(at, table, RULE_KEYS)
        pattern = self._pattern(at, table.get("match"))
        named = [k for k in SPEC_KEYS if k in table]
        if "keep" in table:
            if named:
                self.fail((*at, named[0]), "a rule that keeps a tensor takes no spec keys")
            action: SpecPatch | Keep = Keep(self._reason(at, table["keep"]))
        elif not named:
            keys = ", ".join(SPEC_KEYS)
            self.fail(at, f'a rule needs keep = "reason" or at least one of {keys}')
        else:
            action = self._patch(at, table)
        return Rule(i + 1, pattern, action, line_of(self.lines, at), RuleKind.RECIPE, self.path)

    def ladder(self, value: object) -> tuple[Codec, ...]:
        if not isinstance(value, list) or not value:
            self.fail(("ladder",), 'must be a non-empty list such as ["int4 g128 mse", "int8"]')
        if len(value) > MAX_LADDER:
            self.fail(
                ("ladder",),
                f"{len(value):,} entries, over {MAX_LADDER}: the budget tries every entry on "
                "every tensor it decides; list the few specs worth trying",
            )
        rungs: dict[Codec, int] = {}
        for i, item in enumerate(value):
            spec = self._rung(i, item)
            if spec in rungs:
                self.fail(("ladder", i), f"repeats ladder entry {rungs[spec] + 1}")
            rungs[spec] = i
        return tuple(rungs)

    def _rung(self, i: int, item: object) -> Codec:
        at: TomlPath = ("ladder", i)
        if isinstance(item, str):
            try:
                spec = parse_spec_label(item, writable=True)
            except ValueError as err:
                self.fail(at, str(err))
        else:
            table = self._table(at, item, LADDER_KEYS)
            if "dtype" not in table:
                self.fail(at, 'a ladder entry names its dtype (dtype = "int4", ...)')
            spec = self._patch(at, table).apply(QSpec())
        g = spec.granularity if isinstance(spec, QSpec) else None  # a grid's fields
        if isinstance(g, PerChannel) and g.axis != 0:
            self.fail(at, "ladder channels are along axis 0 (write channel)")
        return spec

    def _table(self, at: TomlPath, value: object, keys: tuple[str, ...]) -> dict[str, object]:
        if not isinstance(value, dict):
            self.fail(at, "must be a table of keys (" + ", ".join(keys) + ")")
        for key in value:
            if key not in keys:
                self.fail((*at, key), "unknown key; use " + ", ".join(keys))
        return value

    def _pattern(self, at: TomlPath, match: object) -> str:
        if match is None:
            self.fail((*at, "match"), 'missing; a rule needs match = "GLOB" (or "re:REGEX")')
        if not isinstance(match, str) or match in ("", "re:"):
            self.fail((*at, "match"), 'must be a non-empty glob or "re:REGEX"')
        if match.startswith("re:"):  # compiled as it will be matched: bounded, never a crash
            try:
                patterns.compiled(match[3:])
            except patterns.PatternError as err:
                self.fail((*at, "match"), str(err))
        elif len(match) > patterns.MAX_PATTERN_CHARS:
            self.fail(
                (*at, "match"),
                f"a glob of {len(match):,} characters (over {patterns.MAX_PATTERN_CHARS:,})",
            )
        return match

    def _reason(self, at: TomlPath, keep: object) -> str:
        if not isinstance(keep, str) or not keep.strip():
            self.fail((*at, "keep"), 'must say why, e.g. keep = "embeddings stay float"')
        return keep

    def _patch(self, at: TomlPath, table: Mapping[str, object]) -> SpecPatch:
        dtype = table.get("dtype")
        family = whole_family(dtype) if isinstance(dtype, str) else None
        if family is not None:
            return self._whole(at, table, str(dtype), family)
        return SpecPatch(
            self._choice(at, table, "scheme", Scheme),
            self._choice(at, table, "dtype", StorageDtype),
            self._granularity(at, table),
            self._choice(at, table, "range", RangeMethod),
        )

    def _whole(
        self, at: TomlPath, table: Mapping[str, object], dtype: str, family: type[Codec]
    ) -> SpecPatch:
        """dtype = "Q6_K": a whole codec (a GGUF block type), which fixes every other field."""
        others = [k for k in SPEC_KEYS if k in table and k != "dtype"]
        if others:
            self.fail((*at, others[0]), f"{dtype} is {family.what}, which fixes its own "
                      "layout; drop this key")  # fmt: skip
        try:
            spec = family.from_dtype(dtype)
        except ValueError as err:
            self.fail((*at, "dtype"), str(err))
        return SpecPatch(codec=spec)

    def _choice(
        self, at: TomlPath, table: Mapping[str, object], key: str, enum_type: type[_E]
    ) -> _E | None:
        value = table.get(key)
        if value is None:
            return None
        for member in enum_type:
            if member.value == value:
                return member
        choices = ", ".join(f'"{m.value}"' for m in enum_type)
        self.fail((*at, key), f"{value!r} is not one of {choices}")

    def _granularity(self, at: TomlPath, table: Mapping[str, object]) -> Granularity | None:
        kind = table.get("granularity")
        axis, size = self._int(at, table, "axis"), self._int(at, table, "group_size")
        if kind is not None and kind not in ("tensor", "channel", "group"):
            self.fail((*at, "granularity"), f'{kind!r} is not one of "tensor", "channel", "group"')
        if size is not None:
            if size < 2:
                self.fail((*at, "group_size"), f"{size} is too small; use 2 or more")
            if kind in ("tensor", "channel"):
                self.fail((*at, "group_size"), f'needs granularity = "group", not "{kind}"')
            if axis not in (None, 0):
                self.fail((*at, "axis"), "groups run along the rows of axis 0; drop axis")
            return PerGroup(size)
        if kind == "group":
            self.fail((*at, "granularity"), '"group" needs group_size = N')
        if axis is not None and kind == "tensor":
            self.fail((*at, "axis"), 'has no meaning with granularity = "tensor"')
        if kind == "tensor":
            return PerTensor()
        return PerChannel(axis or 0) if kind == "channel" or axis is not None else None

    def _int(self, at: TomlPath, table: Mapping[str, object], key: str) -> int | None:
        value = table.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail((*at, key), f"{value!r} is not an integer")
        return value
