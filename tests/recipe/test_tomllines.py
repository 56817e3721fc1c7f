from __future__ import annotations

import json

import tomllib
from hypothesis import given
from hypothesis import strategies as st

from qtool.recipe.tomllines import TomlPath, line_of, toml_lines

TRICKY = ["plain", "# not a comment", "[[rule]]", "dtype = 'x'", '" [[rule]] x = "', "it's", "\\"]
KEYS = ["match", "keep", "dtype", "group_size", "quoted key", "k.dotted"]


def _key(key: str) -> str:
    return json.dumps(key) if " " in key else key  # "quoted key"; k.dotted stays dotted


def _value(text: str, form: int) -> list[str]:
    """A TOML string holding `text`, as a basic, literal or multi-line string (maybe 2 lines)."""
    if form == 0 or "'" in text:
        return [json.dumps(text)]
    if form == 1:
        return [f"'{text}'"]
    return ["'''", f"{text}'''"]  # a multi-line literal string: its first newline is dropped


COMMENTS = st.sampled_from(["", "# [[rule]] it's a comment", "  # dtype = 'int3' \"", "\t"])
PAIRS = st.lists(
    st.tuples(st.sampled_from(KEYS), st.sampled_from(TRICKY), st.integers(0, 2), COMMENTS),
    max_size=4,
    unique_by=lambda p: p[0].split(".")[0],
)


@given(st.lists(PAIRS, max_size=4), COMMENTS)
def test_every_key_of_every_rule_table_has_its_line(
    rules: list[list[tuple[str, str, int, str]]], preamble: str
) -> None:
    lines = [preamble, "top = 1 # a top-level key"]
    expected: dict[TomlPath, int] = {("top",): 2}
    for i, pairs in enumerate(rules):
        lines.append("[[rule]]  # header")
        expected[("rule", i)] = len(lines)
        for key, text, form, comment in pairs:
            value = _value(text, form)
            lines.append(f"{_key(key)} = {value[0]}")
            expected[("rule", i, key.split(".")[0])] = len(lines)
            lines += value[1:]
            lines[-1] += f"  {comment}" if comment.startswith("#") else comment
            lines.append(comment if not comment.startswith("#") else "")
    text = "\n".join(lines) + "\n"
    tomllib.loads(text)  # the generator writes valid TOML
    found = toml_lines(text)
    assert {path: found.get(path) for path in expected} == expected


def test_array_elements_and_inline_tables() -> None:
    text = (
        "ladder = [ # it's a comment with a quote and [[rule]]\n"  # 1
        '  "int4 g32 mse",\n'  # 2
        "  {dtype = 'int8', group_size = 128}, { dtype = \"int4\" },\n"  # 3
        '  """multi\n'  # 4
        "line ] } [\n"  # 5
        '""""",\n'  # 6: the string ends in two quotes
        "  [1, [2, 3]],\n"  # 7
        "  1979-05-27 07:32:00Z,\n"  # 8
        "  { x = 1 }\n"  # 9
        "]\n"  # 10
        'after = "x"\n'  # 11
    )
    assert len(tomllib.loads(text)["ladder"]) == 7
    found = toml_lines(text)
    assert [found[("ladder", i)] for i in range(7)] == [2, 3, 3, 4, 7, 8, 9]
    assert found[("ladder", 1, "group_size")] == 3 and found[("ladder", 2, "dtype")] == 3
    assert found[("ladder", 4, 1, 0)] == 7
    assert found[("after",)] == 11


def test_headers_dotted_and_quoted_keys() -> None:
    text = (
        '[[ rule ]]\n"ma.tch" = 1\n'  # 1-2
        "[table . 'sub.key']\nsub.key.x = 2\n"  # 3-4
        "[[rule]]\r\nmatch = 'a'\r\n"  # 5-6
    )
    tomllib.loads(text)
    found = toml_lines(text)
    assert found[("rule", 0)] == 1 and found[("rule", 0, "ma.tch")] == 2
    assert found[("table", "sub.key")] == 3 and found[("table", "sub.key", "sub", "key", "x")] == 4
    assert found[("rule", 1)] == 5 and found[("rule", 1, "match")] == 6


def test_line_of_falls_back_to_the_longest_recorded_prefix() -> None:
    found = toml_lines('\n[[rule]]\nmatch = "a"\n')
    assert line_of(found, ("rule", 0, "dtype")) == 2
    assert line_of(found, ("rule", 0, "match")) == 3
    assert line_of(found, ("ladder", 0)) == 1
