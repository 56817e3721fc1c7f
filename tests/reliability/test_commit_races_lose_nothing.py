"""The final renames of an output set lose nothing to a race. A file that appears at an output
name after the run's checks (another run, another program) is never replaced without --force:
the run fails naming it, removes its own temps and leaves no other output of its set in place;
of several runs committing one name, exactly one wins. A temp file is removed from the directory
it was created in, even after that directory was moved or swapped for a link mid-run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from qtool.errors import OutputError
from qtool.formats.qtool.manifest import sidecar_path
from qtool.io import atomic, renames
from qtool.io.atomic import OutputSet
from tests.conftest import run_qtool
from tests.outputs import ERROR_LINE, checkpoint, leftovers

THEIRS = b"written by someone else meanwhile"


@pytest.fixture
def src(tmp_path: Path) -> Path:
    path = tmp_path / "in" / "m.safetensors"
    path.parent.mkdir()
    checkpoint(path, tensors=1, rows=32, cols=32)
    return path


def _before_commit(mp: pytest.MonkeyPatch, hook: Callable[[], None]) -> None:
    """Run `hook` once, after every check of the run and every write, just before the commit."""
    real = OutputSet.commit

    def commit(self: OutputSet) -> None:
        hook()
        real(self)

    mp.setattr(OutputSet, "commit", commit)


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("which", ["main", "sidecar"])
def test_a_file_appearing_at_an_output_is_kept(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback: bool, which: str
) -> None:
    """Whichever output of the set it lands on, with renameat2 or the link() fallback."""
    monkeypatch.setattr(renames, "FORCE_FALLBACK", fallback)
    out = tmp_path / "q.safetensors"
    late = out if which == "main" else sidecar_path(out)
    _before_commit(monkeypatch, lambda: late.write_bytes(THEIRS))
    code, stdout, err = run_qtool("quantize", str(src), "-o", str(out))
    assert code == 1 and stdout == "" and ERROR_LINE.match(err), err
    assert f"{late}: appeared while this run was writing; nothing was replaced" in err
    assert "pass --force" in err
    assert late.read_bytes() == THEIRS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", late.name]


@pytest.mark.parametrize("fallback", [False, True])
def test_a_file_appearing_during_the_renames_undoes_the_ones_done(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback: bool
) -> None:
    """The file appears after commit's own checks, right before the set's last rename: that
    rename fails atomically and the outputs renamed before it are taken back."""
    monkeypatch.setattr(renames, "FORCE_FALLBACK", fallback)
    out = tmp_path / "q.safetensors"
    names: list[str] = []
    real_renameat2, real_link = renames.renameat2, os.link

    def appear(new: str, dir_fd: int) -> None:
        names.append(new)
        if len(names) == 2:  # the set's second (last) rename
            fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd)
            os.write(fd, THEIRS)
            os.close(fd)

    def renameat2(dir_fd: int, old: str, new: str, flags: int) -> bool:
        if not renames.FORCE_FALLBACK:  # (it returns False at once then, and link() follows)
            appear(new, dir_fd)
        return real_renameat2(dir_fd, old, new, flags)

    def link(old: str, new: str, **kw: int | bool) -> None:
        appear(new, int(kw["dst_dir_fd"]))
        real_link(old, new, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(renames, "renameat2", renameat2)
    monkeypatch.setattr(os, "link", link)
    code, _, err = run_qtool("quantize", str(src), "-o", str(out))
    assert code == 1 and "appeared while this run was writing" in err, err
    assert len(names) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", names[1]]
    assert (tmp_path / names[1]).read_bytes() == THEIRS


def test_with_force_a_file_appearing_at_the_output_is_replaced(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "q.safetensors"
    _before_commit(monkeypatch, lambda: out.write_bytes(THEIRS))
    code, _, err = run_qtool("quantize", str(src), "-o", str(out), "--force")
    assert code == 0, err
    assert out.read_bytes() != THEIRS and out.read_bytes()[8:9] == b"{"
    assert leftovers(tmp_path) == []


def test_force_of_an_earlier_run_does_not_carry_over(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run without --force after one with it, in the same process, replaces nothing."""
    out = tmp_path / "q.safetensors"
    assert run_qtool("quantize", str(src), "-o", str(out), "--force")[0] == 0
    out.unlink()
    sidecar_path(out).unlink()
    _before_commit(monkeypatch, lambda: out.write_bytes(THEIRS))
    code, _, err = run_qtool("quantize", str(src), "-o", str(out))
    assert code == 1 and "appeared while this run was writing" in err, err
    assert out.read_bytes() == THEIRS


def test_two_sets_committing_one_name_one_wins(tmp_path: Path) -> None:
    """Two runs in one process, each checked (name free) and writing before either commits."""
    final = tmp_path / "a.bin"
    with OutputSet() as first, OutputSet() as second:
        atomic.preflight([final], [], force=False)
        first.create(final).write(b"first")
        atomic.preflight([final], [], force=False)
        second.create(final).write(b"second")
        first.commit()
        with pytest.raises(OutputError, match="appeared while this run was writing"):
            second.commit()
    assert final.read_bytes() == b"first" and sorted(os.listdir(tmp_path)) == ["a.bin"]


_RACER = """
import sys, time
from pathlib import Path
from qtool.errors import OutputError
from qtool.io.atomic import OutputSet, preflight
final, me = Path(sys.argv[1]), sys.argv[2]
preflight([final], [], force=False)
with OutputSet() as outputs:
    outputs.create(final).write(me.encode())
    (final.parent / f"ready-{me}").touch()
    while not (final.parent / "go").exists():
        time.sleep(0.01)
    try:
        outputs.commit()
    except OutputError as err:
        print(err)
        sys.exit(1)
"""


@pytest.mark.slow
def test_processes_committing_one_name_at_once_one_wins(tmp_path: Path) -> None:
    """Real processes, released together once each has written its temp: exactly one exits 0,
    the file is that one's, the others say why and leave no temp."""
    final = tmp_path / "out" / "c.gguf"
    final.parent.mkdir()
    racers = [str(i) for i in range(4)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(final), me],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for me in racers
    ]
    deadline = time.monotonic() + 120  # only catches a racer that never got ready
    while not all((final.parent / f"ready-{me}").exists() for me in racers):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.01)
    (final.parent / "go").touch()
    results = [(p.wait(timeout=120), p.communicate()) for p in procs]
    winners = [me for me, (code, _) in zip(racers, results, strict=True) if code == 0]
    assert len(winners) == 1, results
    assert final.read_bytes() == winners[0].encode()
    for code, (stdout, stderr) in results:
        assert code == 0 or "appeared while this run was writing" in stdout, (stdout, stderr)
    assert leftovers(final.parent) == []


def test_a_moved_output_directory_keeps_no_temp(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-o's directory is moved away and replaced by a link elsewhere while the run writes: the
    run fails naming it, and its temps are removed from the moved directory, not looked for
    through the link."""
    ok, moved, other = tmp_path / "ok", tmp_path / "ok_moved", tmp_path / "o3"
    ok.mkdir()
    other.mkdir()

    def move() -> None:
        ok.rename(moved)
        ok.symlink_to(other)

    _before_commit(monkeypatch, move)
    code, stdout, err = run_qtool("quantize", str(src), "-o", str(ok / "q.safetensors"))
    assert code == 1 and stdout == "" and ERROR_LINE.match(err), err
    assert "was moved or replaced while this run wrote into it" in err
    assert os.listdir(moved) == [] and os.listdir(other) == []


def test_an_abort_after_the_directory_moved_removes_the_temp(tmp_path: Path) -> None:
    """The same for any failure after the move (here a write error), at the OutputSet level."""
    ok, moved = tmp_path / "ok", tmp_path / "ok_moved"
    ok.mkdir()
    with pytest.raises(OSError), OutputSet() as outputs:
        outputs.create(ok / "a.bin").write(b"x")
        ok.rename(moved)
        ok.mkdir()
        raise OSError("a write failed")
    assert os.listdir(moved) == [] and os.listdir(ok) == []


def test_no_replace_rename_where_hard_links_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No renameat2 and no link() (some filesystems): a file present at the commit is still
    refused (checked just before os.replace), an absent one is written."""
    monkeypatch.setattr(renames, "FORCE_FALLBACK", True)

    def no_links(*args: object, **kw: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    new, late = tmp_path / "new.bin", tmp_path / "late.bin"
    atomic.preflight([new, late], [], force=False)
    with OutputSet() as outputs:
        outputs.create(new).write(b"new")
        outputs.commit()
    with OutputSet() as outputs:
        outputs.create(late).write(b"ours")
        late.write_bytes(THEIRS)
        with pytest.raises(OutputError, match="appeared while this run was writing"):
            outputs.commit()
    assert new.read_bytes() == b"new" and late.read_bytes() == THEIRS
    assert leftovers(tmp_path) == []


def test_a_commit_replaces_only_what_its_preflight_allows(tmp_path: Path) -> None:
    """Without force the preflight keeps the name free for the commit; with force, or for a
    name no preflight checked (a library caller rewriting its own file, e.g.
    scripts/make_sample_weights.py), the commit replaces what is there."""
    kept, forced, unchecked = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "c.bin"
    atomic.preflight([kept], [], force=False)
    atomic.preflight([forced], [], force=True)
    for final in (kept, forced, unchecked):
        with OutputSet() as outputs:
            outputs.create(final).write(b"new")
            final.write_bytes(b"old")
            if final is kept:
                with pytest.raises(OutputError):
                    outputs.commit()
            else:
                outputs.commit()
    assert [p.read_bytes() for p in (kept, forced, unchecked)] == [b"old", b"new", b"new"]
    assert leftovers(tmp_path) == []
