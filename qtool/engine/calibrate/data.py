"""Calibration text and its windows: the default text (the docstrings of CPython's standard
library, not eval's pydoc_data topics), text files and JSONL (`text` fields, or chat `messages`
rendered through the model's chat template), several sources mixed window by window.

Windows are `ctx` tokens, non-overlapping, whole (a shorter tail is dropped, as llama-imatrix
drops it); when the tokenizer starts a text with BOS, every window's first token is replaced by
BOS, as llama-imatrix does with its chunks. With several sources, windows are taken from each in
turn, so that `--tokens` draws on all of them."""

from __future__ import annotations

import ast
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from qtool.engine.model.hf import Tokenizer, first_line, guarded, quiet
from qtool.engine.model.text import Text, read_text
from qtool.engine.model.tokens import leading_ids
from qtool.errors import InputError, UsageError
from qtool.io.jsonfile import parse_json

JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass(frozen=True)
class Source:
    """One calibration text: its name (what imatrix.datasets records), its SHA-256 and the
    windows of token ids taken from it."""

    name: str
    sha256: str
    windows: list[list[int]]

    @property
    def tokens(self) -> int:
        return sum(map(len, self.windows))


def default_text() -> Text:
    """The docstrings (module, class, function, in source order) of the top-level modules of
    CPython's standard library, files in sorted name order, joined by blank lines; parsed with
    ast, never imported. It changes with the Python version, which the name says (the SHA-256
    pins the exact text)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue
        docs += _docstrings(tree)
    version = ".".join(str(v) for v in sys.version_info[:3])
    return Text("\n\n".join(docs), f"stdlib docstrings (CPython {version})")


def check_text() -> Text:
    """The default check text of a calibrated method: CPython's LICENSE.txt (the history of the
    software, then the licence terms), English prose of another domain than the docstrings of
    default_text() and than eval's default text; it ships with CPython. UsageError where the
    Python installation lacks it."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if not path.is_file():
        raise UsageError(path, "this Python installation has no LICENSE.txt, the default "
                         "check text; give a check text of another domain",
                         hint="check-text")  # fmt: skip
    version = ".".join(str(v) for v in sys.version_info[:3])
    return Text(read_text(path).content, f"CPython LICENSE.txt (CPython {version})")


def _docstrings(node: ast.AST) -> list[str]:
    found = []
    if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        doc = ast.get_docstring(node)
        if doc:
            found.append(doc)
    for child in ast.iter_child_nodes(node):
        found += _docstrings(child)
    return found


def load_text(path: Path, tokenizer: Tokenizer, purpose: str = "calibrate on") -> Text:
    """A text file, or a JSONL file (by its suffix) rendered to text."""
    text = read_text(path, purpose)
    if path.suffix.lower() not in JSONL_SUFFIXES:
        return text
    return Text(_render_jsonl(path, text.content, tokenizer), text.source)


def _render_jsonl(path: Path, content: str, tokenizer: Tokenizer) -> str:
    """Each line a JSON object with a `text` string or chat `messages` (rendered through the
    tokenizer's chat template); the pieces joined by blank lines."""
    pieces = []
    for number, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = parse_json(line.encode(), path, "line")  # strict, nesting bounded
        except InputError as err:
            why = err.message.removeprefix("not a valid line: ")
            raise InputError(path, f"line {number} is not JSON ({why}); give one JSON object "
                             "per line") from None  # fmt: skip
        if isinstance(doc, dict) and isinstance(doc.get("text"), str):
            pieces.append(doc["text"])
        elif isinstance(doc, dict) and isinstance(doc.get("messages"), list):
            pieces.append(_chat(path, number, doc["messages"], tokenizer))
        else:
            raise InputError(path, f"line {number} has neither a 'text' string nor a "
                             "'messages' list; give one of them per line")  # fmt: skip
    if not pieces:
        raise InputError(path, "holds no line with text; give some text to calibrate on")
    return "\n\n".join(pieces)


def _chat(path: Path, number: int, messages: list[object], tokenizer: Tokenizer) -> str:
    backend = tokenizer.backend
    if not getattr(backend, "chat_template", None):
        raise InputError(path, f"line {number} holds chat messages, but the model's tokenizer "
                         "has no chat template; give 'text' lines instead")  # fmt: skip
    try:
        with quiet(), guarded():
            rendered = backend.apply_chat_template(messages, tokenize=False)
    except Exception as err:
        raise InputError(path, f"line {number}: the chat template fails on its messages: "
                         f"{first_line(err)}") from None  # fmt: skip
    if not isinstance(rendered, str):
        raise InputError(path, f"line {number}: the chat template gives no text")
    return rendered


def take_windows(texts: list[Text], tokenizer: Tokenizer, tokens: int, ctx: int) -> list[Source]:
    """Up to tokens // ctx windows of `ctx` tokens, taken from the texts in turn; InputError
    naming the text when one gives no whole window, or in all fewer than one."""
    wanted = max(tokens // ctx, 1)
    cut: list[list[list[int]]] = []
    for text in texts:
        ids = leading_ids(tokenizer, text.content, wanted * ctx)  # one may give them all
        windows = [ids[s : s + ctx] for s in range(0, len(ids) - ctx + 1, ctx)]
        bos = getattr(tokenizer.backend, "bos_token_id", None)
        if windows and isinstance(bos, int) and ids[0] == bos and ctx > 1:
            windows = [[bos, *w[1:]] for w in windows]  # each window starts a sequence
        if not windows:
            gives = f"{len(ids)} token" if len(ids) == 1 else f"{len(ids)} tokens"
            raise InputError(text.source, f"gives {gives}, fewer than one window of {ctx}; "
                             "give more text or a shorter window")  # fmt: skip
        cut.append(windows)
    taken = [0] * len(texts)
    total = 0
    while total < wanted and any(taken[i] < len(cut[i]) for i in range(len(texts))):
        for i in range(len(texts)):
            if total < wanted and taken[i] < len(cut[i]):
                taken[i] += 1
                total += 1
    return [Source(t.source, t.info.sha256, cut[i][: taken[i]]) for i, t in enumerate(texts)]
