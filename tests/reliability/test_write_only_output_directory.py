"""An output directory one may write into and search but not read (mode 0333 or 1733, a drop
box) passes the preflight, so the commit must work there too: its descriptor for the *at()
calls is opened O_PATH when O_RDONLY is refused. We run as root, who ignores modes, so the
refusal is simulated: every O_RDONLY open of that directory raises PermissionError."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from qtool.formats.qtool.manifest import sidecar_path
from tests.conftest import run_qtool
from tests.outputs import checkpoint, leftovers


def test_quantize_into_a_write_only_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, plain, box = tmp_path / "m.safetensors", tmp_path / "plain", tmp_path / "box"
    checkpoint(src, tensors=1, rows=32, cols=32)
    plain.mkdir()
    box.mkdir()
    assert run_qtool("quantize", str(src), "-o", str(plain / "q.safetensors"))[0] == 0
    real_open = os.open
    opened: list[int] = []

    def write_only(path: object, flags: int, *args: object, **kw: object) -> int:
        if isinstance(path, (str, Path)) and os.path.abspath(path) == str(box):
            opened.append(flags)
            if not flags & (os.O_PATH | os.O_WRONLY | os.O_RDWR):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", write_only)
    code, stdout, err = run_qtool("quantize", str(src), "-o", str(box / "q.safetensors"))
    assert code == 0, err
    assert any(flags & os.O_PATH for flags in opened)  # the retry was taken
    for name in ("q.safetensors", sidecar_path(Path("q.safetensors")).name):
        assert (box / name).read_bytes() == (plain / name).read_bytes()
    assert leftovers(box) == [] and len(os.listdir(box)) == 2


def test_a_directory_output_into_a_write_only_directory_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory output (a sharded checkpoint, compressed-tensors) builds beside its final
    name and lists it: in a drop box it is refused before any work, saying the directory
    cannot be read, not that it is not writable (which it is)."""
    src = Path(__file__).resolve().parents[2] / "sample_weights" / "sharded-mlp"
    box = tmp_path / "box"
    box.mkdir()
    real_open = os.open

    def write_only(path: object, flags: int, *args: object, **kw: object) -> int:
        ours = isinstance(path, (str, Path)) and os.path.abspath(path) == str(box)
        if ours and not flags & (os.O_PATH | os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", write_only)
    code, stdout, err = run_qtool("quantize", str(src), "-o", str(box / "out"))
    assert code == 1 and stdout == "", err
    assert f"cannot read {box}" in err and "write the directory elsewhere" in " ".join(err.split())
    assert os.listdir(box) == []
