"""Names in narrow tables (issue 33 polish): compare and inspect cut tensor names mid-word on an
80-column terminal ("model.layers.0.post_attention_layernor" / "m.weight"). A name now folds
only after a `.` or `_`, and a table folds its names or its descriptions first, whichever
leaves fewer lines (names whole on a tie)."""

from __future__ import annotations

import re

import pytest

from qtool.report import layout
from qtool.report.layout import Column

NAMES = [
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.12.self_attn.o_proj.weight",
    "model.embed_tokens.weight",
]


def _plain(lines: list[layout.Line]) -> list[str]:
    return ["".join(t for t, _ in line).rstrip() for line in lines]


def _table(rows: list[tuple[str, str]], width: int) -> list[str]:
    columns = [
        Column("tensor", [(n, "") for n, _ in rows], fold=12, names=True),
        Column("compared", [(d, "") for _, d in rows], fold=16),
        Column("SQNR dB", [("57.4", "") for _ in rows], right=True),
    ]
    lines = _plain(layout.table(columns, width).lines)
    assert all(layout.cell_width(line) <= width for line in lines)
    return lines[3:-1]


def test_one_long_name_folds_between_words_rather_than_every_description() -> None:
    """SmolLM2's compare at 80 columns: only post_attention_layernorm's rows need the room."""
    rows = [(n, "BF16 vs dequantized") for n in NAMES[1:]] * 5 + [(NAMES[0], "BF16 vs F32")]
    natural = len(NAMES[0]) + len("BF16 vs dequantized") + len("SQNR dB") + 5  # edge, gaps
    lines = _table(rows, natural - 6)
    assert len(lines) == len(rows) + 1  # one row on two lines
    first, rest = lines[-2].split()[0], lines[-1].strip()
    assert first + rest == NAMES[0] and first[-1] in "._"  # between two words of the name
    assert sum("BF16 vs dequantized" in line for line in lines) == 10  # never folded


def test_names_stay_whole_when_a_description_gives_fewer_lines() -> None:
    rows = [(n, "sym int4") for n in NAMES] * 3 + [("lm_head.weight", "kept: 1-D (bias/norm)")]
    natural = len(NAMES[0]) + len("kept: 1-D (bias/norm)") + len("SQNR dB") + 5
    lines = _table(rows, natural - 4)
    assert all(any(name in line for line in lines) for name in NAMES)  # all whole
    assert len(lines) == len(rows) + 1  # the one description folded


@pytest.mark.parametrize("size", [40, 30, 20, 16, 12])
def test_a_name_that_must_fold_breaks_after_a_dot_or_underscore(size: int) -> None:
    for name in NAMES:
        table = layout.table([Column("tensor", [(name, "")], fold=12, names=True)], size + 1)
        pieces = [line.strip() for line in _plain(table.lines)[3:-1]]
        assert "".join(pieces) == name and all(len(p) <= size for p in pieces)
        for piece in pieces[:-1]:  # a piece ends inside a word only if the word is too long
            word = re.split(r"[._]", name[len("".join(pieces[: pieces.index(piece)])) :])[0]
            assert piece[-1] in "._" or len(word) + 1 > size, (name, pieces)
