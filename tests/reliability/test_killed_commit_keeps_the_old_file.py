"""A `--force` run killed inside its commit loses neither pair: when the kill cut the commit
short (the new sidecar in place, the old quantized file not yet replaced), the next run in that
directory keeps the old sidecar as `q.qparams.safetensors.qtool-kept-<time>` (moved back, the old
pair reads again) instead of removing it as a temp; when every rename had happened, the second
names go and the new pair stays. Nothing is ever renamed over a final name by a cleanup. Each
kill is a SIGKILL of a real `qtool quantize` at one system call of the commit."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qtool.formats.qtool.manifest import sidecar_path
from qtool.formats.qtool.reader import QtoolReader
from qtool.io.atomic import remove_stale_temps
from tests.outputs import checkpoint, leftovers

pytestmark = pytest.mark.slow  # every test spawns and kills processes

# A child qtool that SIGKILLs itself at one call of the commit (argv[1]), then runs argv[2:].
CHILD = r"""
import os, signal, sys
point = sys.argv[1]
def die():
    os.kill(os.getpid(), signal.SIGKILL)
def hook(name, when, before=False):
    real = getattr(os, name)
    def hooked(*args, **kwargs):
        if before and when(*args):
            die()
        result = real(*args, **kwargs)
        if when(*args):
            die()
        return result
    setattr(os, name, hooked)
if point == "sidecar-renamed":  # the sidecar in place, the quantized file not yet
    hook("replace", lambda src, dst, **kw: dst == "q.qparams.safetensors")
elif point == "quantized-kept-aside":  # ... and the old quantized file given its second name
    hook("link", lambda src, dst, **kw: dst.startswith(".q.safetensors.qtool-old-"))
elif point == "both-renamed":  # every rename done, the second names not yet dropped
    hook("unlink", lambda name, **kw: ".qtool-old-" in name, before=True)
from qtool.cli import main
sys.argv = ["qtool", *sys.argv[2:]]
main()
"""


def _quantize(src: Path, out: Path, *extra: str, point: str | None = None) -> int:
    argv = ["quantize", str(src), "-o", str(out), *extra]
    cmd = [sys.executable, "-c", CHILD, point, *argv] if point else [
        sys.executable, "-m", "qtool", *argv]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, timeout=600).returncode


def _pair(out: Path) -> tuple[bytes, bytes]:
    return out.read_bytes(), sidecar_path(out).read_bytes()


def _kept(directory: Path) -> dict[str, bytes]:
    return {p.name.split(".qtool-kept-")[0]: p.read_bytes()
            for p in directory.iterdir() if ".qtool-kept-" in p.name}  # fmt: skip


@pytest.mark.parametrize(
    ("point", "cut_short"),
    [("sidecar-renamed", True), ("quantized-kept-aside", True), ("both-renamed", False)],
)
def test_a_commit_killed_at_each_step_loses_neither_pair(
    tmp_path: Path, point: str, cut_short: bool
) -> None:
    src, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    checkpoint(src, tensors=2)
    assert _quantize(src, out, "--scheme", "asym", "--force") == 0
    new = _pair(out)
    assert _quantize(src, out, "--scheme", "sym", "--force") == 0
    old = _pair(out)
    assert old != new
    assert _quantize(src, out, "--scheme", "asym", "--force", point=point) == -9
    assert leftovers(tmp_path)  # the kill left what only the next run can settle

    # the next run writing into the directory (another output) settles it
    assert _quantize(src, tmp_path / "other.safetensors") == 0
    assert leftovers(tmp_path) == []
    if not cut_short:
        assert _pair(out) == new and _kept(tmp_path) == {}
        QtoolReader(out).close()
        return
    assert _pair(out) == (old[0], new[1])  # as the kill left them
    assert _kept(tmp_path) == {sidecar_path(out).name: old[1]}
    (kept,) = tmp_path.glob("*.qtool-kept-*")
    argv = ["dequantize", str(out), "-o", str(tmp_path / "d.safetensors")]
    refused = subprocess.run([sys.executable, "-m", "qtool", *argv], capture_output=True, text=True)
    assert refused.returncode == 1
    assert f"if {kept.name} beside it is the sidecar a killed --force run replaced" in (
        refused.stderr
    )
    kept.replace(sidecar_path(out))  # what the docs tell a user to do
    assert _pair(out) == old
    QtoolReader(out).close()  # the old pair, whole


def _cut_short(directory: Path, final: str, other: str) -> tuple[Path, Path]:
    """What the set 1-00aa's commit leaves when killed after replacing `final` (b"new" there)
    and before renaming `other`: `final`'s second name (b"old") and `other`'s temp."""
    (directory / final).write_bytes(b"new")
    aside = directory / f".{final}.qtool-old-1-00aa"
    aside.write_bytes(b"old")
    temp = directory / f".{other}.qtool-tmp-1-00aa"
    temp.write_bytes(b"whole")
    return aside, temp


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """`path`'s lock held, as a live run (or any reader) can."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def test_a_second_name_beside_a_live_runs_temp_is_left_alone(tmp_path: Path) -> None:
    """A second name nobody could lock (the replaced file was unreadable) while the set's temp
    is held: the run is alive and may still put the file back itself."""
    aside, temp = _cut_short(tmp_path, "q.safetensors", "q.qparams.safetensors")
    with _locked(temp):  # the live run's lock
        assert remove_stale_temps(tmp_path) == 0
        assert aside.read_bytes() == b"old" and temp.exists()
    assert remove_stale_temps(tmp_path) == 2  # once it is dead: kept, temp removed
    assert (tmp_path / "q.safetensors").read_bytes() == b"new"
    assert _kept(tmp_path) == {"q.safetensors": b"old"}
    assert leftovers(tmp_path) == []


def test_another_runs_temp_does_not_make_a_done_commit_look_cut_short(tmp_path: Path) -> None:
    (tmp_path / "q.safetensors").write_bytes(b"new")
    (tmp_path / ".q.safetensors.qtool-old-1-00aa").write_bytes(b"old")
    (tmp_path / ".q.qparams.safetensors.qtool-tmp-1-00bb").write_bytes(b"partial")  # not its set
    assert remove_stale_temps(tmp_path) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["q.safetensors"]
    assert (tmp_path / "q.safetensors").read_bytes() == b"new"


@pytest.mark.skipif(os.geteuid() != 0, reason="gives the planted names another owner (root only)")
def test_names_planted_by_another_user_never_replace_a_file(tmp_path: Path) -> None:
    """In a shared sticky directory anyone may create a second name and a temp of a made-up
    set, or copy the set of another user's leftover temp: root's cleanup never renames over
    the file at the final name (at worst the planted file is kept under a kept name)."""
    tmp_path.chmod(0o1777)
    (tmp_path / "q.safetensors").write_bytes(b"mine")
    planted = [tmp_path / ".q.safetensors.qtool-old-1-00aa",
               tmp_path / ".q.qparams.safetensors.qtool-tmp-1-00aa"]  # fmt: skip
    for p in planted:
        p.write_bytes(b"theirs")
        os.chown(p, 65534, 65534)
    remove_stale_temps(tmp_path)
    assert (tmp_path / "q.safetensors").read_bytes() == b"mine"
    assert leftovers(tmp_path) == []


def test_a_second_name_whose_name_holds_a_newline_is_settled(tmp_path: Path) -> None:
    _cut_short(tmp_path, "q\n.safetensors", "q\n.qparams.safetensors")
    assert remove_stale_temps(tmp_path) == 2
    assert (tmp_path / "q\n.safetensors").read_bytes() == b"new"
    assert _kept(tmp_path) == {"q\n.safetensors": b"old"}


def test_a_temp_stays_while_its_sets_second_name_cannot_be_settled(tmp_path: Path) -> None:
    """Someone holds a lock on the second name (any reader can): the temp that says the commit
    was cut short stays too, so the next run still keeps the file instead of removing it."""
    aside, temp = _cut_short(tmp_path, "q.qparams.safetensors", "q.safetensors")
    with _locked(aside):
        assert remove_stale_temps(tmp_path) == 0
        assert aside.exists() and temp.exists()
    assert remove_stale_temps(tmp_path) == 2
    assert _kept(tmp_path) == {"q.qparams.safetensors": b"old"}
    assert leftovers(tmp_path) == []


def test_a_second_name_that_cannot_be_kept_is_never_removed(tmp_path: Path) -> None:
    """A final name so long that its kept name is over NAME_MAX (255 bytes) while its second
    name fits: both names stay, run after run, rather than the file being lost."""
    final = "q" * 230
    aside = tmp_path / f".{final}.qtool-old-1-00aa"
    aside.write_bytes(b"old")
    (tmp_path / final).write_bytes(b"new")
    temp = tmp_path / ".q.safetensors.qtool-tmp-1-00aa"
    temp.write_bytes(b"whole")
    for _ in range(2):
        assert remove_stale_temps(tmp_path) == 0
        assert aside.read_bytes() == b"old" and temp.exists()


def test_the_hint_names_only_a_kept_name_qtool_gives(tmp_path: Path) -> None:
    src, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    checkpoint(src, tensors=1)
    assert _quantize(src, out) == 0
    assert _quantize(src, tmp_path / "r.safetensors", "--scheme", "asym") == 0
    sidecar_path(out).write_bytes(sidecar_path(tmp_path / "r.safetensors").read_bytes())
    (tmp_path / "q.qparams.safetensors.qtool-kept-zz").write_bytes(b"planted")
    argv = ["dequantize", str(out), "-o", str(tmp_path / "d.safetensors")]
    refused = subprocess.run([sys.executable, "-m", "qtool", *argv], capture_output=True, text=True)
    assert refused.returncode == 1 and "does not belong" in refused.stderr
    assert "qtool-kept" not in refused.stderr


def test_a_replaced_symlinks_second_name_does_not_hold_the_temps(tmp_path: Path) -> None:
    """An output name that was a symlink: its second name is a link to the symlink, which no
    cleanup opens; the set's temp (maybe gigabytes) is still removed."""
    (tmp_path / "q.safetensors").write_bytes(b"new")
    os.symlink("elsewhere", tmp_path / ".q.qparams.safetensors.qtool-old-1-00aa")
    temp = tmp_path / ".q.safetensors.qtool-tmp-1-00aa"
    temp.write_bytes(b"whole")
    assert remove_stale_temps(tmp_path) == 1
    assert not temp.exists()
