"""The plan files name each tensor exactly, whatever its name holds: a saved recipe's rule
matches its one tensor (a glob wildcard `[`, `*`, `?` or a leading `re:` written as an escaped
`re:` pattern; quotes, backslashes, NUL, newline and tab escaped so the TOML parses), and a
tensor-type line survives llama-quantize's reading (split at whitespace, cut at the first `=`,
the pattern lowercased, then regex-searched in the unchanged name) matching its one tensor;
a name it cannot express (non-ASCII, NUL) has no line."""

from __future__ import annotations

import re

from qtool.engine.allocate import _toml_str, exact_pattern, llama_pattern
from qtool.recipe.file import parse_recipe

NAMES = [
    "blk.0.attn_q.weight",
    "a[0].weight",
    "a0.weight",
    "b*.weight",
    "b1.weight",
    "c?.weight",
    "cx.weight",
    "re:d.weight",
    'e"q\\uote.weight',
    "f\x00nul.weight",
    "g\nnew\tline.weight",
    "H=Upper Space.weight",
    "h=upper space.weight",
    "i.(x|y)+$.weight",
]


def test_each_saved_rule_matches_exactly_its_tensor() -> None:
    text = "".join(f"[[rule]]\nmatch = {_toml_str(exact_pattern(n))}\nkeep = \"k\"\n\n"
                   for n in NAMES)  # fmt: skip
    rules = parse_recipe(text).rules
    assert len(rules) == len(NAMES)
    for rule, name in zip(rules, NAMES, strict=True):
        assert [n for n in NAMES if rule.matches(n)] == [name], rule.pattern


def _as_llama_reads(line: str) -> str:
    """quantize.cpp: `file >> arg` (one whitespace-free token), name up to the first `=`,
    std::transform(tolower)."""
    tokens = line.split()
    assert tokens == [line]
    return line.split("=", 1)[0].lower()


def test_each_tensor_type_line_matches_exactly_its_tensor() -> None:
    expressible = [n for n in NAMES if "\x00" not in n]
    for name in expressible:
        pattern = llama_pattern(name)
        assert pattern is not None
        read = _as_llama_reads(f"{pattern}=q4_k")
        assert [n for n in expressible if re.search(read, n)] == [name], read
    assert llama_pattern("f\x00nul.weight") is None
    assert llama_pattern("caf\u00e9.weight") is None


def test_a_recipe_made_with_an_imatrix_says_it_needs_it_again() -> None:
    """The rules pin the specs; the imatrix weighs their range search, so the same bytes need
    it again: the header says so (its name on one comment line, whatever it holds)."""
    from pathlib import Path

    from qtool.engine.allocate import recipe_text
    from qtool.numerics.allocate import Target

    weighted = recipe_text([], Target("bpw", 5), Path("/x/cal\nib.imatrix"))
    assert "--imatrix cal?ib.imatrix" in weighted
    assert parse_recipe(weighted).rules == ()
    assert "--imatrix" not in recipe_text([], Target("bpw", 5))
