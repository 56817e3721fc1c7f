"""recipe/rules.py's matcher (literal names in a dict, globs tried only on the names their
literal prefix or run allows) decides exactly as trying every rule in order with fnmatchcase
and re.fullmatch would."""

from __future__ import annotations

import fnmatch
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.io.stformat import TensorEntry
from qtool.recipe.rules import Keep, Rule, resolve, rules_from_cli, unmatched
from qtool.spec import QSpec

ALPHABET = "ab.1[]!*?"
NAME_ALPHABET = "ab.1[]!*?\n"
globs = st.text(ALPHABET, min_size=1, max_size=7)
regexes = st.sampled_from(["re:a.*", "re:[ab]+", "re:.*1", "re:b?a\\.1"])
names = st.lists(st.text(NAME_ALPHABET, max_size=8), max_size=25, unique=True)


def _naive(rules: tuple[Rule, ...], name: str) -> Rule | None:
    for r in rules:
        p = r.pattern
        hit = re.fullmatch(p[3:], name) if p.startswith("re:") else fnmatch.fnmatchcase(name, p)
        if hit:
            return r
    return None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(globs, regexes), min_size=1, max_size=12), names)
def test_the_first_matching_rule_is_the_one_trying_each_in_order_finds(
    patterns: list[str], names: list[str]
) -> None:
    recipe = tuple(Rule(i + 1, p, Keep(f"rule {i + 1}")) for i, p in enumerate(patterns))
    rules = rules_from_cli(("*1",), ("b*",), recipe)
    for name in names:
        found = resolve(rules, TensorEntry(name, "F32", (4, 4), 0, 0), QSpec())
        assert found.rule is _naive(rules, name), (patterns, name)
    expected = [r for r in rules if not any(_naive((r,), n) for n in names)]
    assert unmatched(rules, names) == expected
