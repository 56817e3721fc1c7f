"""`qtool eval --save-logits` files (formats/logits_file.py) as an input every command recognises:
`inspect` shows their header (what the logits were computed on); any other command is told what
the file is and that `eval --logits` reads it, instead of a safetensors parser's complaint about
a header length."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qtool.errors import InputError
from qtool.formats import detect, registry
from qtool.formats.detect import Detected, Probe

if TYPE_CHECKING:
    from qtool.formats.base import FloatReader
    from qtool.results import InspectSummary

NAME = "qtool-logits"
KIND = "logits"
_MAGIC = b"QTLOGITS"  # logits_file.MAGIC (that module imports torch; detecting must not)
_WHAT = "a qtool eval logits file (eval --save-logits), not a checkpoint"


def _logits(probe: Probe) -> Detected | None:
    if probe.is_dir or probe.directory is not None:
        return None
    from qtool.io.safeopen import open_regular

    try:
        with open_regular(probe.path) as f:
            if f.read(len(_MAGIC)) != _MAGIC:
                return None
    except InputError:
        return None  # not a regular file: the readers after this one say so
    return Detected(probe.path, KIND, NAME, _WHAT, False, (probe.path,))


_READ_BY = f"{_WHAT}; give it to qtool eval FLOAT QUANT --logits FILE"


def _reader(found: Detected, qparams: Path | None) -> FloatReader:
    raise InputError(found.path, _READ_BY)


def _inspect(found: Detected) -> InspectSummary:
    from qtool.formats.logits_file import read_logits_info
    from qtool.results import InspectSummary

    info = read_logits_info(found.path)
    shown: dict[str, object] = {
        "text_source": info.text_source,
        "text_sha256": info.text_sha256,
        "tokens": info.tokens,
        "tokens_sha256": info.tokens_sha256,
        "ctx": info.ctx,
        "windows": len(info.windows),
        "vocab": info.vocab,
        "dtype": info.dtype,
        "architecture": info.architecture,
        "config_sha256": info.config_sha256,
        "tokenizer_sha256": info.tokenizer_sha256,
    }
    note = f"{_WHAT}: FLOAT's side of qtool eval, read back by eval --logits"
    return InspectSummary(
        str(found.path), KIND, [], {k: str(v) for k, v in shown.items()}, notes=[note]
    )


detect.register(NAME, _logits)
registry.register(registry.FormatEntry(NAME, _reader, _inspect, not_a_checkpoint=_READ_BY))
