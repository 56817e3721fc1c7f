"""A change of an input's status alone while qtool reads it (chmod, `touch -a` or a backup tool
putting the atime back, a hard link made to it) no longer stops the run: each moves only the
ctime, which `check_unchanged` compared with the rest of the stamp, so a long run ended with
"changed while qtool was reading it; run again" though no byte had changed. A ctime-only change
is the mark of a rewrite whose writer put the mtime back too, so it is accepted only once every
span the reader read reads the same again (io/filestamp.py ReadLog); a rewrite of bytes already
read is still refused (tests/reliability/test_inputs_rewritten_with_mtime_restored.py), the
path must still name the file read, and each reader re-reads at most MAX_RECHECKS times. An
imatrix, small and read whole before any use, is read once more instead."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from itertools import count
from pathlib import Path

import numpy as np
import pytest
import torch

import qtool.formats.imatrix as imatrix_format
from qtool.errors import InputError
from qtool.formats.imatrix import dat as dat_format
from qtool.gguf_types import ValueType
from qtool.io import checkpoint as checkpoint_module
from qtool.io.checkpoint import Checkpoint, open_checkpoint
from qtool.io.filestamp import MAX_RECHECKS
from qtool.io.gguf_file import GGUFFile
from qtool.io.gguf_layout import GGUFValue
from qtool.io.gguf_write import write_gguf
from tests.conftest import Invoke
from tests.outputs import ERROR_LINE, checkpoint, leftovers, snapshot
from tests.reliability.test_imatrix_hostile import ONE, TAIL, dat, gguf_file, good
from tests.reliability.test_inputs_rewritten_with_mtime_restored import rewrite_keeping_mtime

Act = Callable[[Path], None]
_names = count()


def _chmod(path: Path) -> None:
    os.chmod(path, 0o640 if path.stat().st_mode & 0o777 == 0o644 else 0o644)


def _atime(path: Path) -> None:  # touch -a, or tar --atime-preserve putting it back
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns - 10**9 * (1 + next(_names)), st.st_mtime_ns))


def _link(path: Path) -> None:
    os.link(path, path.with_name(f"{path.name}.link{next(_names)}"))


ACTS = {"chmod": _chmod, "atime": _atime, "link": _link}


def status_change(path: Path, act: Act) -> None:
    """`act` on `path` (again if it must, until the clock ticks): its ctime alone moved."""
    before = path.stat()
    act(path)
    while path.stat().st_ctime_ns == before.st_ctime_ns:
        act(path)
    now = path.stat()
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns)  # fmt: skip


def _files(directory: Path) -> dict[str, bytes]:
    return {Path(path).name: data for path, data in snapshot(directory).items()}


def _disturb_after_first_read(
    monkeypatch: pytest.MonkeyPatch, src: Path, change: Callable[[Path], None]
) -> list[bool]:
    """`change(src)` once the run's first tensor of `src` was read (its plan made)."""
    real, done = Checkpoint._read, []

    def read(self: Checkpoint, *args: object, **kwargs: object) -> torch.Tensor:
        result = real(self, *args, **kwargs)  # type: ignore[arg-type]
        if not done and self.path == src:
            change(src)
            done.append(True)
        return result

    monkeypatch.setattr(Checkpoint, "_read", read)
    return done


@pytest.mark.parametrize("act", ACTS.values(), ids=ACTS.keys())
def test_quantize_goes_on_through_a_status_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, invoke: Invoke, act: Act
) -> None:
    """Exit 0 and the same bytes as a run nothing disturbed (before: exit 1, "changed")."""
    src = tmp_path / "m.safetensors"
    checkpoint(src, tensors=4, rows=64, cols=64)
    calm, moved = tmp_path / "calm", tmp_path / "moved"
    calm.mkdir()
    moved.mkdir()
    code, _, err = invoke("quantize", str(src), "-o", str(calm / "q.safetensors"))
    assert code == 0, err
    done = _disturb_after_first_read(monkeypatch, src, lambda p: status_change(p, act))
    code, _, err = invoke("quantize", str(src), "-o", str(moved / "q.safetensors"))
    assert done and code == 0, err
    assert _files(moved) == _files(calm) and leftovers(moved) == []


def test_quantize_reads_a_rewrite_of_bytes_not_yet_read_as_the_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, invoke: Invoke
) -> None:
    """A rewrite (mtime put back) of only what the run had not read yet tears nothing: every
    byte used is the file's as it now is, and the output is a calm run's of the new file."""
    src, new = tmp_path / "m.safetensors", tmp_path / "new.safetensors"
    checkpoint(src, tensors=4, rows=64, cols=64)
    ckpt = open_checkpoint(src)
    first_end = ckpt.data_start + ckpt.entries[0].end
    ckpt.close()
    data = src.read_bytes()
    new.write_bytes(data[:first_end] + bytes(len(data) - first_end))
    calm, moved = tmp_path / "calm", tmp_path / "moved"
    calm.mkdir()
    moved.mkdir()
    code, _, err = invoke("quantize", str(new), "-o", str(calm / "q.safetensors"))
    assert code == 0, err
    done = _disturb_after_first_read(
        monkeypatch, src, lambda p: rewrite_keeping_mtime(p, new.read_bytes())
    )
    code, _, err = invoke("quantize", str(src), "-o", str(moved / "q.safetensors"))
    assert done and code == 0, err
    assert _files(moved) == _files(calm)


def _safetensors(tmp_path: Path) -> Path:
    src = tmp_path / "m.safetensors"
    checkpoint(src, tensors=2, rows=16, cols=16)
    return src


def _gguf(tmp_path: Path) -> Path:
    src = tmp_path / "m.gguf"
    meta = {"general.architecture": GGUFValue(ValueType.STRING, "llama")}
    values = np.arange(128, dtype=np.float32)
    write_gguf(src, meta, [("w", "F32", (32, 4)), ("v", "F32", (32, 4))],
               [values.tobytes(), (-values).tobytes()])  # fmt: skip
    return src


def _pickle(tmp_path: Path) -> Path:
    src = tmp_path / "m.pt"
    torch.save({"w": torch.randn(16, 16), "v": torch.randn(16, 16)}, src)
    return src


MAKERS = {"safetensors": _safetensors, "gguf": _gguf, "pickle": _pickle}


@pytest.mark.parametrize("act", ACTS.values(), ids=ACTS.keys())
@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_checkpoint_readers_accept_a_status_change(
    tmp_path: Path, make: Callable[[Path], Path], act: Act
) -> None:
    src = make(tmp_path)
    ckpt = open_checkpoint(src)
    first = ckpt.tensor(ckpt.entries[0]).clone()
    status_change(src, act)
    ckpt.check_unchanged()
    rest = [ckpt.tensor(e).clone() for e in ckpt.entries[1:]]
    ckpt.check_unchanged()
    calm = open_checkpoint(src)
    pairs = zip([first, *rest], calm.entries, strict=True)
    assert all(torch.equal(t, calm.tensor(e)) for t, e in pairs)


@pytest.mark.parametrize("act", ACTS.values(), ids=ACTS.keys())
def test_gguf_file_accepts_a_status_change(tmp_path: Path, act: Act) -> None:
    src = _gguf(tmp_path)
    with GGUFFile(src) as f:
        f.tensor_bytes(f.header.tensors[0])
        status_change(src, act)
        f.check_unchanged()
        f.tensor_bytes(f.header.tensors[1])
        f.check_unchanged()


@pytest.mark.parametrize("make", [_safetensors, _gguf], ids=["safetensors", "gguf"])
def test_header_rewritten_with_mtime_restored_is_refused(
    tmp_path: Path, make: Callable[[Path], Path]
) -> None:
    """The header's bytes are checked like the data's: the offsets and dtypes the values were
    read under (here one byte of it, in the first tensor's name, before any tensor is read)."""
    src = make(tmp_path)
    ckpt = open_checkpoint(src)
    name = ckpt.entries[0].name.encode()
    data = src.read_bytes()
    at = data.index(name)
    rewrite_keeping_mtime(src, data[:at] + b"x" + data[at + 1 :])
    with pytest.raises(InputError, match="changed while qtool was reading it"):
        ckpt.check_unchanged()


@pytest.mark.parametrize("how", ["renamed over", "deleted", "deleted, read through its fd"])
def test_path_no_longer_naming_the_file_is_refused(tmp_path: Path, how: str) -> None:
    """Removing the file's name moves only its ctime (its link count) too: the values read are
    whole, but the path no longer names them, so this stays a change (also where the path is
    /proc/self/fd/N, as quantize HF_DIR --format gguf reads the weights, which still opens)."""
    src = _safetensors(tmp_path)
    held = os.open(src, os.O_RDONLY)
    fd_path = Path(f"/proc/self/fd/{held}")
    ckpt = open_checkpoint(fd_path if how.endswith("fd") else src)
    ckpt.tensor(ckpt.entries[0])
    if how.startswith("deleted"):
        src.unlink()
    else:
        shutil.copy2(src, tmp_path / "copy")
        os.replace(tmp_path / "copy", src)
    with pytest.raises(InputError, match="changed while qtool was reading it"):
        ckpt.check_unchanged()
    os.close(held)


def test_each_status_change_costs_one_re_read_and_no_more_than_max_rechecks(
    tmp_path: Path,
) -> None:
    """The work is bounded: each ctime-only change re-reads the bytes read so far once (the
    header's and the tensors'), and the change after MAX_RECHECKS of them is refused."""
    src = _safetensors(tmp_path)
    ckpt = open_checkpoint(src)
    for e in ckpt.entries:
        ckpt.tensor(e)
    ckpt.tensor(ckpt.entries[0])  # read twice: one span
    read = ckpt.data_start + sum(e.nbytes for e in ckpt.entries)
    log = ckpt._log
    assert log is not None
    for n in range(1, MAX_RECHECKS + 1):
        status_change(src, _chmod)
        ckpt.check_unchanged()
        ckpt.check_unchanged()  # nothing moved since: nothing re-read
        assert (log.rechecks, log.reread) == (n, n * read)
    status_change(src, _chmod)
    with pytest.raises(InputError, match="its status .* changed more than 4 times"):
        ckpt.check_unchanged()
    assert log.reread == MAX_RECHECKS * read


def test_pickle_rewritten_with_mtime_restored_during_its_load_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pickle is read whole when opened: a change during the load (here a rewrite with the
    mtime put back, after torch's first read) is refused; after it, nothing read can tear."""
    src = _pickle(tmp_path)
    size = src.stat().st_size
    real, done = checkpoint_module._Watched.readinto, []

    def readinto(self: checkpoint_module._Watched, buffer: object) -> int:
        if not done:
            done.append(rewrite_keeping_mtime(src, src.read_bytes()[:64] + bytes(size - 64)))
        return real(self, buffer)

    monkeypatch.setattr(checkpoint_module._Watched, "readinto", readinto)
    with pytest.raises(InputError, match="changed while qtool was reading it"):
        open_checkpoint(src)
    assert done


def test_cli_refusal_after_too_many_status_changes_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, invoke: Invoke
) -> None:
    """A file whose status keeps changing is refused: one line naming it and saying that its
    status (not its bytes) kept changing, since running again at once fails the same way."""
    src, out = tmp_path / "m.safetensors", tmp_path / "out"
    out.mkdir()
    checkpoint(src, tensors=4, rows=64, cols=64)
    real = Checkpoint.check_unchanged

    def check(self: Checkpoint) -> None:
        for _ in range(MAX_RECHECKS + 1):
            status_change(src, _chmod)
            real(self)

    monkeypatch.setattr(Checkpoint, "check_unchanged", check)
    code, stdout, err = invoke("quantize", str(src), "-o", str(out / "q.safetensors"))
    assert code == 1 and stdout == "" and ERROR_LINE.match(err), err
    assert str(src) in err and "run again once nothing is changing it" in " ".join(err.split())
    assert list(out.iterdir()) == [] and leftovers(out) == []


def _imatrix(tmp_path: Path, kind: str) -> tuple[Path, object, str]:
    """An imatrix file and the function its read calls once parsed (before the hash)."""
    if kind == "gguf":
        return gguf_file(tmp_path / "m.gguf", good()), imatrix_format, "read_gguf_from"
    path = tmp_path / "m.dat"
    path.write_bytes(dat([ONE], TAIL))
    return path, dat_format, "_trailer"


@pytest.mark.parametrize("act", ACTS.values(), ids=ACTS.keys())
@pytest.mark.parametrize("kind", ["gguf", "dat"])
def test_imatrix_read_again_after_a_status_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, act: Act
) -> None:
    """Read once more, whole (it is small and read before any use): the same statistics and
    SHA-256 as a calm read, after two reads; a change during each read is still refused."""
    path, module, name = _imatrix(tmp_path, kind)
    calm = imatrix_format.read_imatrix_file(path)
    real, calls = getattr(module, name), []

    def then_change(*args: object) -> object:
        out = real(*args)
        calls.append(None)
        if len(calls) == 1:
            status_change(path, act)
        return out

    monkeypatch.setattr(module, name, then_change)
    got = imatrix_format.read_imatrix_file(path)
    assert len(calls) == 2 and got.sha256 == calm.sha256
    assert got.imatrix.entries.keys() == calm.imatrix.entries.keys()
    for key, stats in got.imatrix.entries.items():
        assert np.array_equal(stats.sums, calm.imatrix.entries[key].sums)
    calls.clear()

    def always(*args: object) -> object:
        out = real(*args)
        calls.append(None)
        status_change(path, act)
        return out

    monkeypatch.setattr(module, name, always)
    with pytest.raises(InputError, match="changed while qtool was reading it"):
        imatrix_format.read_imatrix_file(path)
    assert len(calls) == 2  # one read again, no more
