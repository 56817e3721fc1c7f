"""A file rewritten in place while qtool reads it, by a writer that puts its mtime back
(`os.utime`, `touch -r`, `rsync -t`, `tar x`), is refused: `check_unchanged` compared only the
size and the mtime, so the same size and the old mtime passed and the run wrote an output from
torn values with exit 0. Every reader's check (safetensors, GGUF, torch pickles, imatrices:
io/filestamp.py) now compares the ctime too, which no user can set, and the device and inode (a
file renamed over the path of a pickle, read whole through its path).

The writers here wait, if they must, for the clock to tick past the file's last change: a change
within one tick of the file system's clock is invisible to any stat."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import qtool.formats.imatrix as imatrix_format
from qtool.errors import InputError
from qtool.formats.imatrix import dat as dat_format
from qtool.gguf_types import ValueType
from qtool.io.checkpoint import open_checkpoint
from qtool.io.gguf_file import GGUFFile
from qtool.io.gguf_layout import GGUFValue
from qtool.io.gguf_write import write_gguf
from tests.outputs import ERROR_LINE, checkpoint, leftovers
from tests.reliability.test_imatrix_hostile import ONE, TAIL, dat, gguf_file, good


def rewrite_keeping_mtime(path: Path, data: bytes) -> None:
    """`data` over the file's first bytes in place, its mtime put back, once its ctime moved."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    while os.stat(path).st_ctime_ns == before.st_ctime_ns:  # same tick: let the clock move
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    now = os.stat(path)
    assert (now.st_size, now.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def _zeroed_tail(path: Path, keep: int) -> bytes:
    return path.read_bytes()[:keep] + bytes(path.stat().st_size - keep)


def _safetensors(tmp_path: Path) -> tuple[Path, Callable[[], bytes]]:
    src = tmp_path / "m.safetensors"
    checkpoint(src, tensors=2, rows=16, cols=16)
    return src, lambda: _zeroed_tail(src, 200)


def _pickle(tmp_path: Path) -> tuple[Path, Callable[[], bytes]]:
    src = tmp_path / "m.pt"
    torch.save({"w": torch.randn(16, 16)}, src)
    return src, lambda: _zeroed_tail(src, 64)


def _gguf_checkpoint(tmp_path: Path) -> tuple[Path, Callable[[], bytes]]:
    src = tmp_path / "m.gguf"
    meta = {"general.architecture": GGUFValue(ValueType.STRING, "llama")}
    write_gguf(src, meta, [("w", "F32", (32, 4))], [np.ones((4, 32), np.float32).tobytes()])
    return src, lambda: src.read_bytes()[:-64] + bytes(64)


# A pickle is read whole when opened: a rewrite once it is loaded tears nothing (one during the
# load is refused: tests/reliability/test_input_status_change_not_a_change.py).
@pytest.mark.parametrize("make", [_safetensors, _gguf_checkpoint], ids=["safetensors", "gguf"])
def test_checkpoint_rewritten_with_mtime_restored(
    tmp_path: Path, make: Callable[[Path], tuple[Path, Callable[[], bytes]]]
) -> None:
    src, torn = make(tmp_path)
    ckpt = open_checkpoint(src)
    ckpt.tensor(ckpt.entries[0])
    ckpt.check_unchanged()  # nothing changed yet
    rewrite_keeping_mtime(src, torn())
    with pytest.raises(InputError, match="changed while qtool was reading it"):
        ckpt.check_unchanged()
    ckpt.close()


def test_gguf_file_rewritten_with_mtime_restored(tmp_path: Path) -> None:
    src, torn = _gguf_checkpoint(tmp_path)
    with GGUFFile(src) as f:
        f.tensor_bytes(f.header.tensors[0])
        f.check_unchanged()
        rewrite_keeping_mtime(src, torn())
        with pytest.raises(InputError, match="changed while qtool was reading it"):
            f.check_unchanged()


def test_pickle_replaced_by_one_of_the_same_size_and_mtime(tmp_path: Path) -> None:
    """A pickle is read whole when opened and checked through its path afterwards: another file
    of the same size and mtime renamed over it is not the file that was read."""
    src, other = tmp_path / "m.pt", tmp_path / "n.pt"  # names of one length: the same size
    torch.save({"w": torch.zeros(16, 16)}, src)
    torch.save({"w": torch.ones(16, 16)}, other)
    assert src.stat().st_size == other.stat().st_size
    ckpt = open_checkpoint(src)
    st = src.stat()
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, src)
    with pytest.raises(InputError, match="changed while qtool was reading it"):
        ckpt.check_unchanged()


# argv: the input, then qtool's argv. Once the first read was done, the input's data (the
# tensor read too: a rewrite of bytes not read yet alone tears nothing) is zeroed in place and
# its mtime put back.
CHILD = r"""
import os, sys
from qtool.io import checkpoint
from tests.reliability.test_inputs_rewritten_with_mtime_restored import rewrite_keeping_mtime

real, done, src = checkpoint.Checkpoint._read, [], sys.argv[1]
def read(self, *args, **kwargs):
    result = real(self, *args, **kwargs)
    if not done and str(self.path) == src:
        keep = self.data_start
        done.append(rewrite_keeping_mtime(self.path, open(src, "rb").read()[:keep]
                                          + bytes(os.path.getsize(src) - keep)))
    return result
checkpoint.Checkpoint._read = read
from qtool.cli import main
sys.argv = ["qtool", *sys.argv[2:]]
main()
"""


@pytest.mark.slow  # spawns a qtool process
def test_quantize_refuses_input_rewritten_with_mtime_restored(tmp_path: Path) -> None:
    """The run's own check (before the commit) sees it: one line, exit 1, nothing written
    (before: exit 0, the output quantized from zeros)."""
    src, out = tmp_path / "m.safetensors", tmp_path / "out"
    out.mkdir()
    checkpoint(src, tensors=4, rows=64, cols=64)
    cmd = [sys.executable, "-c", CHILD, str(src), "quantize", str(src), "-o",
           str(out / "q.safetensors")]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(root)])}  # CHILD's import
    proc = subprocess.run(cmd, capture_output=True, env=env, timeout=600, check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 1, (proc.returncode, err)
    assert proc.stdout == b"" and ERROR_LINE.match(err), err
    assert str(src) in err and "changed while" in err, err
    assert list(out.iterdir()) == [] and leftovers(out) == []


@pytest.mark.parametrize("kind", ["gguf", "dat"])
def test_imatrix_rewritten_with_mtime_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Rewritten once parsed, before the file is hashed and checked (the .dat reader's own
    check, after its last entry, too)."""
    if kind == "gguf":
        path = gguf_file(tmp_path / "m.gguf", good())
        module, name = imatrix_format, "read_gguf_from"
    else:
        path = tmp_path / "m.dat"
        path.write_bytes(dat([ONE], TAIL))
        module, name = dat_format, "_trailer"
    real = getattr(module, name)

    def then_rewrite(*args: object) -> object:
        out = real(*args)
        data = path.read_bytes()
        rewrite_keeping_mtime(path, data[:-8] + bytes(8))
        return out

    monkeypatch.setattr(module, name, then_rewrite)
    with pytest.raises(InputError, match="changed while qtool was reading it"):
        imatrix_format.read_imatrix_file(path)
