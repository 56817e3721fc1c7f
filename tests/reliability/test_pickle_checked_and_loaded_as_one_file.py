"""A torch pickle (.pt) is checked and loaded through one open file, and what goes wrong while
torch.load reads it is said for what it is.

- The zip check (no compressed members: a zip-bomb pattern) opened the path and torch.load
  opened it again: a bomb renamed over the path between the two was loaded (1 GiB from 1 MB,
  exit 0). Now both read one descriptor: the bomb is never read, and the file read losing its
  name (its ctime moves) is "changed while qtool was reading it".
- The same bomb written into the file in place after the check (same inode): each read torch
  makes is checked against the file's stamp at open (io/filestamp.py), so the change is refused
  before torch decompresses anything.
- A file changed while torch.load reads it (truncated) was "corrupt checkpoint ...; re-export
  it": whenever the file's stamp differs from the one at open, it is "changed while qtool was
  reading it; run again", before the file is blamed. The stamp was taken after the load, so a
  change during the load went unseen.
- torch.load running out of memory (torch's "can't allocate memory", MemoryError) was "corrupt
  checkpoint; re-export it": now it does not fit the memory qtool may use (the bytes named),
  raise the limit."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from qtool.errors import InputError
from qtool.io import checkpoint
from qtool.io.checkpoint import open_checkpoint

BENIGN = {"w": torch.arange(256, dtype=torch.float32).reshape(16, 16)}


def _bomb(path: Path, nbytes: int) -> None:
    """A torch.save zip whose one tensor of `nbytes` zeros is deflated (torch would load it)."""
    plain = path.with_suffix(".plain")
    torch.save({"w": torch.zeros(nbytes // 4)}, plain)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    plain.unlink()
    assert path.stat().st_size < nbytes // 100


def _after_zip_check(monkeypatch: pytest.MonkeyPatch, change: Callable[[], None]) -> None:
    real = checkpoint._check_zip

    def checked(*args: object) -> None:
        real(*args)  # type: ignore[arg-type]
        change()

    monkeypatch.setattr(checkpoint, "_check_zip", checked)


def test_bomb_renamed_over_the_path_after_the_check_is_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, bomb = tmp_path / "m.pt", tmp_path / "bomb.pt"
    torch.save(BENIGN, src)
    _bomb(bomb, 64 << 20)
    _after_zip_check(monkeypatch, lambda: os.replace(bomb, src))
    loaded: list[dict[str, torch.Tensor]] = []
    real_load = torch.load

    def load(*args: object, **kwargs: object) -> object:
        loaded.append(real_load(*args, **kwargs))  # type: ignore[arg-type]
        return loaded[-1]

    monkeypatch.setattr(torch, "load", load)
    # the file read lost its name (its ctime moved: torch's first read stops) and the path
    # names another file
    with pytest.raises(InputError, match="changed while qtool was reading it"):
        open_checkpoint(src)
    assert all(torch.equal(got["w"], BENIGN["w"]) for got in loaded)  # never the bomb's


def test_bomb_written_in_place_after_the_check_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, bomb = tmp_path / "m.pt", tmp_path / "bomb.pt"
    torch.save(BENIGN, src)
    _bomb(bomb, 64 << 20)

    def overwrite() -> None:
        before = os.stat(src).st_ctime_ns
        with open(src, "r+b") as f:
            f.write(bomb.read_bytes())
            f.truncate()
        while os.stat(src).st_ctime_ns == before:  # a change within one clock tick is unseen
            os.utime(src)

    _after_zip_check(monkeypatch, overwrite)
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    with pytest.raises(InputError, match="changed while qtool was reading it; run again"):
        open_checkpoint(src)
    assert loads == [1]


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_pickle_truncated_while_loaded_is_changed_not_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zipped: bool
) -> None:
    src = tmp_path / "m.pt"
    torch.save(
        {f"w{i}": torch.randn(64, 64) for i in range(4)}, src,
        _use_new_zipfile_serialization=zipped,
    )  # fmt: skip
    real_load = torch.load

    def truncated_load(*args: object, **kwargs: object) -> object:
        os.truncate(src, src.stat().st_size // 2)  # another process, once the load began
        return real_load(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "load", truncated_load)
    with pytest.raises(InputError) as err:
        open_checkpoint(src)
    assert "changed while qtool was reading it; run again" in str(err.value), err.value
    assert "corrupt" not in str(err.value)


# argv: the .pt file. The address space is capped just above what the process holds once torch
# and the reader are imported, so the load's allocation of the file's tensor fails.
CHILD = r"""
import resource, sys
from pathlib import Path
from qtool.errors import InputError
from qtool.io.checkpoint import open_checkpoint

vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + (48 << 20),) * 2)
try:
    open_checkpoint(Path(sys.argv[1]))
except InputError as err:
    print(err)
"""


@pytest.mark.slow  # spawns a process that imports torch
def test_pickle_over_the_memory_limit_says_so(tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    torch.save({"w": torch.zeros(256 << 18)}, src)  # 256 MiB of float32
    proc = subprocess.run([sys.executable, "-c", CHILD, str(src)], capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip
    line = proc.stdout.strip()
    assert proc.returncode == 0, proc.stderr
    assert str(src) in line and "do not fit in the memory qtool may use" in line, line
    assert "raise the limit" in line and f"{src.stat().st_size:,} bytes" in line, line
    assert "corrupt" not in line, line
