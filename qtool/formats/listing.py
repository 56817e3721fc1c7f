"""What `qtool inspect` shows, the parts every format shares (torch-free for safetensors): a
row per tensor of a header, a plain checkpoint file (a torch pickle has to be loaded, safely,
to be listed), and a directory's weight files listed one after another."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from qtool.errors import InputError
from qtool.formats.detect import Detected
from qtool.io.index import check_inside
from qtool.io.safeopen import open_regular
from qtool.io.stformat import Header, HeaderError, TensorEntry, not_safetensors_message, read_header
from qtool.results import InspectRow, InspectSummary


def row(entry: TensorEntry, qinfo: dict[str, object] | None = None) -> InspectRow:
    return InspectRow(entry.name, entry.dtype, entry.shape, entry.numel, entry.nbytes, qinfo)


def try_header(path: Path) -> Header | None:
    """The safetensors header, or None for a torch archive or pickle (checkpoint.sniff's rule);
    InputError for anything else that is not a regular safetensors file."""
    if not path.is_file():
        raise InputError(path, "not a regular file; give a checkpoint file")
    with open_regular(path) as f:
        head = f.read(8)
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return None
    try:
        return read_header(path)
    except HeaderError as err:
        if head[:1] == b"\x80" or path.suffix in (".pt", ".pth", ".bin"):
            return None  # the pickle reader says what it is
        raise InputError(path, not_safetensors_message(path, err)) from None


def checkpoint_file(path: Path) -> InspectSummary:
    """A float checkpoint file: its tensors and metadata."""
    header = try_header(path)
    if header is None:
        return pickle_file(path)
    return InspectSummary(
        str(path), "checkpoint", [row(e) for e in header.tensors], header.metadata
    )


def pickle_file(path: Path) -> InspectSummary:
    from qtool.io.checkpoint import open_checkpoint  # imports torch: only pickles pay for it

    ckpt = open_checkpoint(path)
    try:
        rows = [row(e) for e in ckpt.entries]
        notes = [f"skipped non-tensor entries: {', '.join(ckpt.skipped)}"] if ckpt.skipped else []
        return InspectSummary(str(path), "checkpoint", rows, None, notes=notes)
    finally:
        ckpt.close()


def directory(
    found: Detected, one: Callable[[Path], InspectSummary], kind: str, sharded_kind: str
) -> InspectSummary:
    """A directory's weight files, each listed by `one` (after checking, through the directory
    held open, that it is a regular file inside it), as one summary of `kind` (`sharded_kind`
    with an index); notes name their file."""
    parts = []
    for w in found.weights:
        if found.within is not None:
            check_inside(found.within, w)  # each read again by `one`
        parts.append(one(w))
    rows = [r for part in parts for r in part.rows]
    notes = [f"{w.name}: {n}" for w, p in zip(found.weights, parts, strict=True) for n in p.notes]
    if found.index is not None:
        path, kind, metadata = found.index.index, sharded_kind, None
    else:
        path, metadata = found.directory or found.path, parts[0].metadata
    return InspectSummary(str(path), kind, rows, metadata, notes=notes, shards=len(parts))
