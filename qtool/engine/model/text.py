"""The evaluation text and how it is cut (torch-free): the default text every CPython has
(pydoc_data), a --text file read like every other input, windows of tokens for causal LMs and
sentences for encoders."""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from qtool.errors import InputError
from qtool.eval_results import TextInfo
from qtool.io.safeopen import read_bounded

MAX_TEXT_BYTES = 64_000_000
DEFAULT_SOURCE = "pydoc_data topics (CPython "  # the default text's source, less the version


@dataclass(frozen=True)
class Text:
    content: str
    source: str

    @property
    def info(self) -> TextInfo:
        digest = hashlib.sha256(self.content.encode("utf-8")).hexdigest()
        return TextInfo(self.source, len(self.content), digest)


def default_text() -> Text:
    """CPython's own documentation topics (pydoc_data.topics, shipped with every CPython): the
    topics in sorted key order, joined by blank lines. It changes with the Python version,
    which the source names (the SHA-256 in the report pins the exact text)."""
    from pydoc_data.topics import topics

    content = "\n\n".join(topics[key] for key in sorted(topics))
    version = ".".join(str(v) for v in sys.version_info[:3])
    return Text(content, f"{DEFAULT_SOURCE}{version})")


def read_text(path: Path, purpose: str = "evaluate on") -> Text:
    """A UTF-8 text file (a regular file, at most MAX_TEXT_BYTES; a BOM is dropped); `purpose`
    ends the refusal of an empty one ("give some text to PURPOSE")."""
    data = read_bounded(path, MAX_TEXT_BYTES, "the text file")
    try:
        content = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise InputError(
            path, f"not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start}); "
            "give a UTF-8 text file",
        ) from None  # fmt: skip
    if not content.strip():
        raise InputError(path, f"the text file is empty; give some text to {purpose}")
    return Text(content, str(path))


def windows(count: int, ctx: int) -> list[tuple[int, int]]:
    """[start, end) of the non-overlapping windows of `ctx` tokens that cover `count` tokens;
    the last, shorter one is kept when it has 2 or more tokens (one prediction)."""
    if ctx < 2:
        raise ValueError(f"a window needs at least 2 tokens, got {ctx}")
    spans = [(s, min(s + ctx, count)) for s in range(0, count, ctx)]
    return [(s, e) for s, e in spans if e - s >= 2]


_PARAGRAPH = re.compile(r"\n[ \t]*\n")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences(text: str) -> list[str]:
    """The text's paragraphs (cut at blank lines, each one's white space collapsed to single
    spaces) cut after . ! ? followed by white space; pieces without a letter or digit (rules,
    lone punctuation) are dropped."""
    return list(iter_sentences(text))


def iter_sentences(text: str) -> Iterator[str]:
    """sentences(), one at a time: a caller that needs the first few never cuts the rest."""
    start = 0
    for gap in _PARAGRAPH.finditer(text):
        yield from _cut(text[start : gap.start()])
        start = gap.end()
    yield from _cut(text[start:])


def _cut(paragraph: str) -> Iterator[str]:
    flat = " ".join(paragraph.split())
    return (s for s in _SENTENCE_END.split(flat) if any(c.isalnum() for c in s))
