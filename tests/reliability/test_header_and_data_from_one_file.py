"""A checkpoint's tensors are read with the offsets of the header of the very file their bytes
come from. The safetensors header was parsed from one open of the path and the data read from a
second: a file of the same size with its tensors in another order, renamed over the path in
between, was read with the first file's offsets (tensor `a` gave `b`'s values, and the check
before the commit passed, since the descriptor read from was never changed). Likewise a header
parsed before the stamp check_unchanged compares was taken: a rewrite in place, its mtime put
back, in between went unseen. Either is now read consistently (the header parsed through the
descriptor the data is read from, stamped before the parse) or refused as changed."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from qtool.errors import InputError
from qtool.io import checkpoint
from qtool.io.checkpoint import open_checkpoint
from qtool.io.safeopen import InputDir
from tests.reliability.test_inputs_rewritten_with_mtime_restored import rewrite_keeping_mtime

VALUES = {"a": 1.0, "b": 2.0}


def _file(order: tuple[str, str]) -> bytes:
    """A safetensors file holding a = 1.0 and b = 2.0 (4 float32 each), stored in `order`: the
    files of both orders have the same size and the same header length."""
    doc = {
        name: {"dtype": "F32", "shape": [4], "data_offsets": [16 * i, 16 * (i + 1)]}
        for i, name in enumerate(order)
    }
    raw = json.dumps(dict(sorted(doc.items()))).encode()
    raw += b" " * (-len(raw) % 8)
    data = b"".join(struct.pack("<4f", *[VALUES[n]] * 4) for n in order)
    return struct.pack("<Q", len(raw)) + raw + data


def _read_all(ckpt: checkpoint.Checkpoint) -> dict[str, float]:
    got = {e.name: ckpt.tensor(e) for e in ckpt.entries}
    ckpt.check_unchanged()
    ckpt.close()
    for name, t in got.items():
        assert torch.equal(t, torch.full((4,), VALUES[name])), (name, t)
    return {name: float(t[0]) for name, t in got.items()}


def _read_or_refused(open_it: Callable[[], checkpoint.Checkpoint]) -> None:
    """Each tensor has its own values, or the change is reported: never another's bytes."""
    try:
        ckpt = open_it()
    except InputError as err:
        assert "changed" in err.message, err.message
        return
    try:
        assert _read_all(ckpt) == VALUES
    except InputError as err:
        assert "changed" in err.message, err.message


def test_renamed_over_between_sniff_and_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, other = tmp_path / "m.safetensors", tmp_path / "other"
    src.write_bytes(_file(("a", "b")))
    other.write_bytes(_file(("b", "a")))
    assert src.stat().st_size == other.stat().st_size
    real = checkpoint.read_header

    def then_replace(path: Path) -> object:
        header = real(path)
        if other.exists():
            os.replace(other, src)
        return header

    monkeypatch.setattr(checkpoint, "read_header", then_replace)
    _read_or_refused(lambda: open_checkpoint(src))
    assert not other.exists()  # the rename happened while the checkpoint was opened


def test_rewritten_with_mtime_restored_between_header_and_stamp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a checkpoint directory (the header parsed from the descriptor the data is read
    from), rewritten in place with the tensors' order swapped once the header was parsed."""
    src = tmp_path / "m.safetensors"
    src.write_bytes(_file(("a", "b")))
    real, done = checkpoint.read_header_file, []

    def then_rewrite(f: object) -> object:
        header = real(f)  # type: ignore[arg-type]
        if not done:
            done.append(rewrite_keeping_mtime(src, _file(("b", "a"))))
        return header

    monkeypatch.setattr(checkpoint, "read_header_file", then_rewrite)
    within = InputDir(tmp_path)
    try:
        _read_or_refused(lambda: open_checkpoint(src, within))
    finally:
        within.close()
    assert done
