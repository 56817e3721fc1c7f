"""A change of a checkpoint's status alone (chmod: the ctime moves, nothing else) between the
stamp taken at its open and the check that its header's bytes are the file stamped (a GGUF's
header parse, which can be long, lies in between) is no change: the header's bytes are parsed
again and, giving the same header, the checkpoint is read as usual (it was refused as
"changed", the false alarm the ReadLog removed elsewhere). A rewrite in that window, the mtime
put back, that gives another header is still refused."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from qtool.errors import ChangedError
from qtool.gguf_types import ValueType
from qtool.io import checkpoint, gguf_checkpoint
from qtool.io.checkpoint import open_checkpoint
from qtool.io.gguf_layout import GGUFValue
from qtool.io.gguf_write import write_gguf
from tests.outputs import checkpoint as make_checkpoint
from tests.reliability.test_inputs_rewritten_with_mtime_restored import rewrite_keeping_mtime


def _chmod(path: Path) -> None:
    before = os.stat(path).st_ctime_ns
    mode = os.stat(path).st_mode & 0o777
    while os.stat(path).st_ctime_ns == before:  # same tick: let the clock move
        os.chmod(path, mode ^ 0o040)
        os.chmod(path, mode)


def _gguf(path: Path, name: str = "w") -> Path:
    meta = {"general.architecture": GGUFValue(ValueType.STRING, "llama")}
    data = np.arange(128, dtype=np.float32).reshape(4, 32)
    write_gguf(path, meta, [(name, "F32", (32, 4))], [data.tobytes()])
    return path


def _after_open(monkeypatch: pytest.MonkeyPatch, src: Path, then: Callable[[Path], None]) -> None:
    """`then(src)` once the file is stamped and its header parsed, before the checkpoint
    takes the descriptor."""
    gguf = src.suffix == ".gguf"
    module, name = (gguf_checkpoint, "open_gguf_data") if gguf else (checkpoint, "read_header_file")
    real, done = getattr(module, name), []

    def wrapped(arg: object) -> object:
        out = real(arg)
        if not done:
            done.append(then(src))
        return out

    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_a_chmod_while_opening_is_no_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    if kind == "gguf":
        src = _gguf(tmp_path / "m.gguf")
    else:
        src = tmp_path / "m.safetensors"
        make_checkpoint(src, tensors=2, rows=8, cols=8)
    calm = open_checkpoint(src)
    want = {e.name: calm.tensor(e).clone() for e in calm.entries}
    calm.close()
    _after_open(monkeypatch, src, _chmod)
    ckpt = open_checkpoint(src)
    got = {e.name: ckpt.tensor(e) for e in ckpt.entries}
    ckpt.check_unchanged()
    ckpt.close()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_gguf_header_rewritten_while_opening_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another tensor name, the same size and mtime: the header's bytes give another header."""
    src = _gguf(tmp_path / "m.gguf")
    other = _gguf(tmp_path / "other.gguf", name="v")
    assert src.stat().st_size == other.stat().st_size
    _after_open(monkeypatch, src, lambda p: rewrite_keeping_mtime(p, other.read_bytes()))
    with pytest.raises(ChangedError, match="changed while qtool was reading it"):
        open_checkpoint(src)
