"""Plain-text layout for a given width: tables and summary lines, as lines of styled segments.

Each table is laid out once: the widths come from one pass over the cells. When it is wider
than the width, its columns close up (two spaces between them instead of three), then its
optional columns are hidden in their order (the caller says which were and notes it), and then
its foldable columns are folded onto more lines: descriptions at spaces, names after a `.` or
`_` (a word cut only when it is longer than the column), the names or the descriptions first,
whichever leaves fewer lines (the names whole on a tie). Summary lines are wrapped at their phrase
boundaries (` · `, `, `), continued two spaces in. No rich here: console.py prints the lines,
with their styles on a terminal and as plain text elsewhere.
"""

from __future__ import annotations

import textwrap
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field

Segment = tuple[str, str]  # text, style ("" for none; a rich style name on a terminal)
Line = list[Segment]
GAP = "   "  # between columns
TIGHT = "  "  # between the columns of a table that is too wide with GAP
EDGE = " "  # before the first column
RULE = "─"
INDENT = "  "  # continuation lines of a wrapped summary


def cell_width(text: str) -> int:
    """Terminal cells `text` takes: East Asian wide characters two, combining marks none."""
    if text.isascii():
        return len(text)
    width = 0
    for c in text:
        if unicodedata.combining(c):
            continue
        width += 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1
    return width


@dataclass(frozen=True)
class Column:
    """One column: its header, a cell per row, and how it gives way when the table is too wide
    (`hide`: hidden in increasing order, 0 never; `fold`: folded down to this width, 0 never)."""

    header: str
    cells: Sequence[Segment]
    right: bool = False
    hide: int = 0
    fold: int = 0
    label: str = ""  # the name a note gives it when hidden (else the header)
    names: bool = False  # tensor names: folded between their words

    @property
    def name(self) -> str:
        return self.label or self.header


@dataclass(frozen=True)
class Table:
    """A laid-out table: its lines and the names of the columns hidden to fit."""

    lines: list[Line]
    hidden: list[str] = field(default_factory=list)


def table(columns: Sequence[Column], width: int | None) -> Table:
    """The table's lines (a blank line, the header, a rule, the rows, a blank line) within
    `width` cells (None: as wide as its content)."""
    shown = list(columns)
    widths = {id(c): _natural(c) for c in shown}
    gap = GAP if width is None or _total(shown, widths, GAP) <= width else TIGHT
    hidden: list[str] = []
    for c in sorted((c for c in columns if c.hide), key=lambda c: c.hide):
        if width is None or _total(shown, widths, gap) <= width:
            break
        shown.remove(c)
        hidden.append(c.name)
    if width is not None and _total(shown, widths, gap) > width:
        widths = _fewest_lines(shown, widths, _total(shown, widths, gap) - width)
    sizes = [widths[id(c)] for c in shown]
    lines: list[Line] = [[]]
    lines.append(_joined([(c.header, "bold") for c in shown], shown, sizes, gap))
    lines.append([(EDGE + RULE * (sum(sizes) + len(gap) * (len(sizes) - 1)), "")])
    rows = len(shown[0].cells) if shown else 0
    for r in range(rows):
        lines += _row([c.cells[r] for c in shown], shown, sizes, gap)
    lines.append([])
    return Table(lines, hidden)


def _natural(c: Column) -> int:
    return max([cell_width(c.header), *(cell_width(text) for text, _ in c.cells)])


def _total(shown: Sequence[Column], widths: dict[int, int], gap: str) -> int:
    return len(EDGE) + sum(widths[id(c)] for c in shown) + len(gap) * (len(shown) - 1)


def _fewest_lines(shown: Sequence[Column], widths: dict[int, int], excess: int) -> dict[int, int]:
    """The widths after folding `excess` cells away, split between the names and the other
    foldable columns (the descriptions) as leaves the table fewest lines; on a tie the names
    give least. Every split is tried: all from the descriptions can double every row, all from
    the names fold every name, and a few cells from each often keeps both to one or two lines."""
    names = [c for c in shown if c.fold and c.names]
    others = [c for c in shown if c.fold and not c.names]
    room = sum(max(0, widths[id(c)] - _least(c)) for c in names)
    counts: dict[tuple[int, int], list[int]] = {}  # (column, width): lines of each row

    def lines(c: Column, size: int) -> list[int]:
        if (id(c), size) not in counts:
            counts[id(c), size] = [len(_pieces(text, c, size)) for text, _ in c.cells]
        return counts[id(c), size]

    best: tuple[tuple[int, int], dict[int, int]] | None = None
    for k in range(min(excess, room) + 1):  # k cells from the names
        trial = dict(widths)
        left = _fold(names, trial, k) + _fold(others, trial, excess - k)
        rows = [lines(c, trial[id(c)]) for c in names + others]
        height = sum(map(max, zip(*rows, strict=True))) if rows else 0
        if best is None or (left, height) < best[0]:
            best = ((left, height), trial)
    assert best is not None
    return best[1]


def _least(c: Column) -> int:
    return max(c.fold, cell_width(c.header))


def _pieces(text: str, c: Column, size: int) -> list[str]:
    if cell_width(text) <= size:
        return [text]
    return _name_folded(text, size) if c.names else _folded(text, size)


def _fold(columns: Sequence[Column], widths: dict[int, int], excess: int) -> int:
    """Take `excess` cells from `columns`, widest first, none below its minimum; the cells
    that could not be taken."""
    for c in sorted(columns, key=lambda c: -widths[id(c)]):
        take = min(excess, max(0, widths[id(c)] - _least(c)))
        widths[id(c)] -= take
        excess -= take
    return max(0, excess)


def _row(
    cells: Sequence[Segment], shown: Sequence[Column], sizes: Sequence[int], gap: str
) -> list[Line]:
    """One row, over as many lines as its tallest folded cell needs."""
    pieces = [
        _pieces(text, c, size) for (text, _), c, size in zip(cells, shown, sizes, strict=True)
    ]
    height = max(len(p) for p in pieces)
    out = []
    for i in range(height):
        texts = [
            (p[i] if i < len(p) else "", style) for p, (_, style) in zip(pieces, cells, strict=True)
        ]
        out.append(_joined(texts, shown, sizes, gap))
    return out


def _joined(
    cells: Sequence[Segment], shown: Sequence[Column], sizes: Sequence[int], gap: str
) -> Line:
    line: Line = [(EDGE, "")]
    for k, ((text, style), c, size) in enumerate(zip(cells, shown, sizes, strict=True)):
        pad = " " * max(0, size - cell_width(text))
        if k:
            line.append((gap, ""))
        line += [(pad, ""), (text, style)] if c.right else [(text, style), (pad, "")]
    while line and not line[-1][0].strip():  # no trailing spaces
        line.pop()
    return line


def _folded(text: str, size: int) -> list[str]:
    """`text` over lines of at most `size` cells: at spaces, else cut (names have none)."""
    if " " in text.strip():
        wrapped = textwrap.wrap(text, size, break_on_hyphens=False)
        if all(cell_width(w) <= size for w in wrapped):
            return wrapped
    out, current = [], ""
    for ch in text:
        if cell_width(current + ch) > size and current:
            out.append(current)
            current = ""
        current += ch
    return [*out, current]


def _name_folded(text: str, size: int) -> list[str]:
    """A name over lines of at most `size` cells, each line ending after a `.` or `_` where
    one fits (`model.layers.0.post_attention_` / `layernorm.weight`), else cut."""
    out: list[str] = []
    while cell_width(text) > size:
        fits = _fitting(text, size)
        cut = max(text.rfind(".", 0, fits), text.rfind("_", 0, fits)) + 1
        cut = cut if cut > 0 else fits
        out.append(text[:cut])
        text = text[cut:]
    return [*out, text]


def _fitting(text: str, size: int) -> int:
    """How many leading characters of `text` fit in `size` cells (at least one)."""
    width = 0
    for i, ch in enumerate(text):
        width += cell_width(ch)
        if width > size:
            return max(1, i)
    return len(text)


def phrases(parts: Sequence[str], width: int | None, sep: str = " · ") -> list[str]:
    """`parts` joined by `sep` on lines of at most `width` cells, broken only between parts
    (a comma stays at the end of its line, a ` · ` goes; a part too long for a line of its own
    is wrapped at its spaces; one word never is)."""
    lines: list[str] = []
    current = ""
    for part in parts:
        joined = current + sep + part if current else part
        if width is None or cell_width(joined) <= width or not current:
            current = joined
            continue
        lines.append(current + (sep.rstrip() if sep.strip() != "·" else ""))
        current = INDENT + part
    lines.append(current)
    if width is None:
        return lines
    return [piece for line in lines for piece in _long(line, width)]


def _long(line: str, width: int) -> list[str]:
    if cell_width(line) <= width:
        return [line]
    body = line.removeprefix(INDENT)
    first = line[: len(line) - len(body)]
    return textwrap.wrap(body, width, initial_indent=first, subsequent_indent=INDENT,
                         break_long_words=False, break_on_hyphens=False)  # fmt: skip
