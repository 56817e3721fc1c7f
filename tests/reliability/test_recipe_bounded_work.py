"""Issue 28, class 3 (recipes): the work of matching a recipe is bounded by what the model
holds, never by a number of patterns in a file. A 1 MB recipe of 29,000 globs took 87 s for
1,000 tensors and over 10 minutes for 10,000: every glob was tried on every name, twice (to
resolve, then to warn of rules that match nothing), and only `re:` patterns had a time budget.
Now a recipe of more than MAX_PATTERNS pattern rules is refused before any is compiled, a
glob is tried only on the names its literal prefix or run allows, and globs share the 5 s
budget of `re:` patterns."""

from __future__ import annotations

from pathlib import Path

import pytest

from qtool import patterns
from qtool.errors import RecipeError
from qtool.io.stformat import TensorEntry
from qtool.recipe.file import MAX_LADDER, MAX_PATTERNS, load_recipe, parse_recipe
from qtool.recipe.rules import Rule, resolve, rules_from_cli, unmatched
from qtool.spec import QSpec

NAMES = [f"model.layers.{i // 7}.mlp.proj{i % 7}.weight" for i in range(300)]


def _recipe(globs: list[str]) -> str:
    return "".join(f'[[rule]]\nmatch="{g}"\nkeep="k"\n' for g in globs)


def test_a_recipe_of_more_pattern_rules_than_the_cap_is_refused(tmp_path: Path) -> None:
    """Refused when read, naming the file (patterns compile lazily, on the first name tried,
    so nothing was compiled for it)."""
    path = tmp_path / "hostile.toml"
    path.write_text(_recipe([f"*q{i:05d}*" for i in range(29_000)]))  # 1 MB, as found
    assert path.stat().st_size <= 1 << 20
    with pytest.raises(RecipeError, match=r"29,000 rules match by pattern .* over 1,000") as err:
        load_recipe(path)
    assert err.value.path == str(path)
    literal = [f"model.layers.{i}.mlp.proj0.weight" for i in range(5_000)]  # names cost nothing
    assert len(parse_recipe(_recipe(literal)).rules) == 5_000
    with pytest.raises(RecipeError, match="a glob of 1,001 characters"):
        parse_recipe(_recipe(["*" + "a" * 1_000]))


def test_globs_are_tried_only_on_names_they_can_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting tries of a rule on a name: MAX_PATTERNS globs none of the names can match
    cost no try at all (before: globs x names, twice), whatever their number."""
    tries: list[tuple[str, str]] = []
    real = Rule.matches

    def counted(self: Rule, name: str) -> bool:
        tries.append((self.pattern, name))
        return real(self, name)

    monkeypatch.setattr(Rule, "matches", counted)
    globs = [f"*q{i:05d}*" for i in range(MAX_PATTERNS - 3)] + ["*.proj3.*", "model.*.proj6.*"]
    recipe = parse_recipe(_recipe([*globs, NAMES[0]]), "r.toml")
    rules = rules_from_cli((), (), recipe.rules)
    with patterns.bounded():
        decided = [resolve(rules, TensorEntry(n, "F32", (4, 4), 0, 0), QSpec()).rule for n in NAMES]
    left = unmatched(rules, NAMES)
    assert [r.pattern if r else None for r in decided[:8]] == [
        NAMES[0], None, None, "*.proj3.*", None, None, "model.*.proj6.*", None
    ]  # fmt: skip
    assert len(left) == MAX_PATTERNS - 3
    # one try per name and glob that could match (its prefix or run is in the name), at most
    assert len(tries) <= 2 * len(NAMES), len(tries)


def test_globs_are_charged_to_the_time_budget_of_re_patterns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The budget is spent (a limit of 0 s): the first glob tried is refused, naming the file
    and line, as an `re:` pattern is (before, only `re:` patterns counted)."""
    monkeypatch.setattr(patterns, "TOTAL_LIMIT_S", 0.0)
    recipe = parse_recipe(_recipe(["model.*.proj3.*"]), "r.toml")
    rules = rules_from_cli((), (), recipe.rules)
    entry = TensorEntry(NAMES[3], "F32", (4, 4), 0, 0)
    with pytest.raises(RecipeError, match=r"took over 0 s in total") as err:
        resolve(rules, entry, QSpec())
    assert err.value.path == "r.toml"
    with pytest.raises(RecipeError, match=r"line 1: .*took over 0 s in total"):
        unmatched(recipe.rules, NAMES)


def test_a_ladder_is_bounded_and_tries_each_spec_once(tmp_path: Path) -> None:
    """The error budget tries every ladder entry on every tensor it decides: a ladder of 28,000
    entries (885 KB) cost 2 s per tensor. Over MAX_LADDER entries, or an entry repeated, is
    refused naming the file and the entry's line."""
    path = tmp_path / "ladder.toml"
    rungs = ",".join(f'{{dtype="int8",group_size={n}}}' for n in range(2, 28_002))
    path.write_text(f"ladder = [\n{rungs}\n]\n")
    with pytest.raises(RecipeError, match=rf"28,000 entries, over {MAX_LADDER}") as err:
        load_recipe(path)
    assert err.value.path == str(path)
    with pytest.raises(RecipeError, match=r"line 3: .*ladder entry 2.*repeats ladder entry 1"):
        parse_recipe('ladder = [\n"int8",\n"sym int8 channel",\n]\n')
    assert len(parse_recipe('ladder = ["int4 g128 mse", "int8"]').ladder or ()) == 2
