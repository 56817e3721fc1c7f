"""The texts a quantized checkpoint records it was calibrated on or checked with, whatever its
format (docs/formats.md, "Calibration texts"): a compressed-tensors config's
`quantization_config.qtool.texts`, a qtool sidecar's `qtool.texts` metadata, a GGUF's
llama-quantize key `quantize.imatrix.dataset` (a name only). `qtool eval` compares them with its
text. The records only inform a warning: what cannot be read as one is left out, never fatal
(the checkpoint's own reader has already judged its files)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from qtool.calibration import TEXTS_KEY, Role, TextUse, parse_texts
from qtool.errors import QtoolError
from qtool.formats.detect import Detected
from qtool.formats.gguf.writer import IMATRIX_DATASET_KEY
from qtool.formats.qtool.manifest import locate_sidecar
from qtool.formats.qtool.writer import TEXTS_KEY as SIDECAR_TEXTS_KEY
from qtool.io.gguf_file import GGUFFile
from qtool.io.jsonfile import parse_json
from qtool.io.safeopen import Refused, open_regular
from qtool.io.stformat import read_header_file


def recorded_texts(found: Detected) -> tuple[TextUse, ...]:
    """Every text `found` records, in the order recorded, without repeats (shards repeat them)."""
    seen: dict[TextUse, None] = {}
    for text in _records(found):
        seen.setdefault(text)
    return tuple(seen)


def _records(found: Detected) -> Iterator[TextUse]:
    config = found.config
    qconfig = config.get("quantization_config") if isinstance(config, dict) else None
    record = qconfig.get("qtool") if isinstance(qconfig, dict) else None
    if isinstance(record, dict):
        yield from parse_texts(record.get(TEXTS_KEY))
    for weights in found.weights:
        try:
            with _open(found, weights) as f:
                gguf = f.read(4) == b"GGUF"
            yield from _gguf(weights) if gguf else _sidecar(found, weights)
        except (OSError, ValueError, QtoolError, Refused):  # damaged or refused: no record
            continue


def _open(found: Detected, path: Path) -> BinaryIO:
    """A file of `found`: through its directory's descriptor when it lies in it (never a path
    walked again, as the loaders read it), else opened as a regular file."""
    within = found.within
    if within is not None and path.parent == within.path:
        return os.fdopen(within.open_fd(path.name), "rb")
    return open_regular(path)


def _gguf(path: Path) -> Iterator[TextUse]:
    """llama-quantize records the imatrix's first dataset by name only: matched by name."""
    with GGUFFile(path) as f:
        value = f.header.metadata.get(IMATRIX_DATASET_KEY)
    if value is not None and isinstance(value.value, str) and value.value:
        yield TextUse.of(value.value, None, None, Role.CALIBRATION)


def _sidecar(found: Detected, path: Path) -> Iterator[TextUse]:
    with _open(found, path) as f:
        side, _ = locate_sidecar(path, read_header_file(f).metadata)
    try:
        with _open(found, side) as f:
            recorded = (read_header_file(f).metadata or {}).get(SIDECAR_TEXTS_KEY)
    except FileNotFoundError:  # no sidecar: not a qtool-format file
        return
    if recorded is not None:
        yield from parse_texts(parse_json(recorded.encode(), side, "record of texts"))
