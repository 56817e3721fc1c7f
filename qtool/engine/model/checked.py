"""What transformers and tokenizers are given to read: never the user's directory, only a private
copy of the files they need, each read by qtool first as every input is read.

A library handed a directory opens whatever it finds there by path, following links:
`generation_config.json` or `additional_chat_templates/*.jinja` leading to a secret or to a
sparse gigabyte, a FIFO that hangs it, a file swapped after qtool's check. So the tokenizer's
files are read through the model directory's descriptor (regular files inside it, no link out,
at most MAX_TOKENIZER_BYTES each, JSON strict and nested at most 100 levels) and written into a
new directory only this process can enter (mode 0700, removed on exit); the library reads that
copy (`qtool-eval-*` in the temp directory; a killed run's copy is removed by the next
run). Files eval does not use (generation and chat templates, custom code) are never copied.
Torch-free.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from qtool.errors import InputError, OutputError
from qtool.io.jsonfile import parse_json
from qtool.io.safeopen import InputDir
from qtool.io.tempdirs import private_scratch

MAX_TOKENIZER_BYTES = 64_000_000
"""Per tokenizer file. The largest real ones are a few tens of MB (Gemma's tokenizer.json:
33 MB; Llama 3's: 9 MB; sentencepiece models: 1 to 5 MB); a tokenizer library holds several
times a file's size while it parses it."""
MAX_TOKENIZER_TOTAL = 2 * MAX_TOKENIZER_BYTES
"""All of one model's tokenizer files together."""


@contextlib.contextmanager
def checked_copy(path: Path, names: Iterable[str]) -> Iterator[Path]:
    """A private directory holding the files `names` of the model directory `path` that exist
    there, each checked and copied (InputError naming the file otherwise); removed on exit."""
    with contextlib.closing(InputDir(path)) as within, private_dir("eval") as scratch:
        total = 0
        for name in sorted(set(names) & set(within.names())):
            data = within.read(name, MAX_TOKENIZER_BYTES, "a tokenizer file")
            total += len(data)
            if total > MAX_TOKENIZER_TOTAL:
                raise InputError(
                    path / name, f"the tokenizer files are over {MAX_TOKENIZER_TOTAL:,} bytes "
                    "together; refusing to read them",
                )  # fmt: skip
            if name.endswith(".json"):
                parse_json(data, path / name, name)  # what the library would choke on
            _write_new(scratch / name, data)
        yield scratch


@contextlib.contextmanager
def private_dir(label: str) -> Iterator[Path]:
    """A private temporary directory (OutputError if none can be made); removed on exit."""
    with contextlib.ExitStack() as stack:
        try:
            path = stack.enter_context(private_scratch(label))
        except OSError as err:
            raise OutputError(None, f"cannot make a private temporary directory: {err}") from None
        yield path


_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_new(path: Path, data: bytes) -> None:
    try:
        with os.fdopen(os.open(path, _NEW_FILE, 0o600), "wb") as f:
            f.write(data)
    except OSError as err:
        raise OutputError(path.parent, f"cannot copy the tokenizer files here: {err}") from None
