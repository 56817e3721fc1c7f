"""A commit that fails at any rename leaves none of its set in place, whichever way each member
was renamed: the no-replace ones (names checked free without --force) are removed, and so are
the members renamed with os.replace (--force, or names no preflight checked) that replaced
nothing; one that replaced a file puts that file back. A set mixing the two kinds used to
leave its os.replace'd members in place (the file they replaced gone) while the commit said
nothing of the set was kept. Without hard links the replaced file cannot be kept aside: the
member stays, as the commit's docstring says."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from qtool.errors import OutputError
from qtool.io import atomic, commit, renames
from qtool.io.atomic import OutputSet
from tests.outputs import leftovers

THEIRS = b"written by someone else meanwhile"


def _fail_the_last_rename(mp: pytest.MonkeyPatch, how: str) -> None:
    """The set's last (no-replace) rename fails: a file appears right before it, or EIO."""
    real = renames.renameat2

    def renameat2(dir_fd: int, old: str, new: str, flags: int) -> bool:
        if new == "last.bin":
            if how == "eio":
                raise OSError(errno.EIO, os.strerror(errno.EIO), new)
            fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd)
            os.write(fd, THEIRS)
            os.close(fd)
        return real(dir_fd, old, new, flags)

    mp.setattr(renames, "renameat2", renameat2)


@pytest.mark.parametrize("how", ["appeared", "eio"])
@pytest.mark.parametrize("before", [b"the user's old file", None])
@pytest.mark.parametrize("kind", ["force", "unchecked"])
def test_an_os_replaced_member_is_taken_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, before: bytes | None, kind: str
) -> None:
    first, last = tmp_path / "first.bin", tmp_path / "last.bin"
    if before is not None:
        first.write_bytes(before)
    if kind == "force":
        atomic.preflight([first], [], force=True)
    atomic.preflight([last], [], force=False)
    _fail_the_last_rename(monkeypatch, how)
    with OutputSet() as outputs:
        outputs.create(first).write(b"new first")
        outputs.create(last, last=True).write(b"new last")
        with pytest.raises(OutputError) as refused:
            outputs.commit()
    assert str(last) in str(refused.value)
    assert (first.read_bytes() if first.exists() else None) == before
    assert (last.read_bytes() if last.exists() else None) == (THEIRS if how == "appeared" else None)
    assert leftovers(tmp_path) == []
    if before is not None:
        assert first.stat().st_nlink == 1  # its second name, kept during the commit, is gone


def test_a_successful_commit_over_a_file_keeps_no_second_name(tmp_path: Path) -> None:
    final = tmp_path / "a.bin"
    final.write_bytes(b"old")
    atomic.preflight([final], [], force=True)
    with OutputSet() as outputs:
        outputs.create(final).write(b"new")
        outputs.commit()
    assert final.read_bytes() == b"new" and final.stat().st_nlink == 1
    assert os.listdir(tmp_path) == ["a.bin"]


def test_without_hard_links_a_replaced_file_cannot_be_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As documented: the member that replaced a file stays (the rest is withdrawn)."""
    first, last = tmp_path / "first.bin", tmp_path / "last.bin"
    first.write_bytes(b"old")
    atomic.preflight([first], [], force=True)
    atomic.preflight([last], [], force=False)

    def no_links(*args: object, **kw: object) -> None:
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    _fail_the_last_rename(monkeypatch, "eio")
    monkeypatch.setattr(os, "link", no_links)
    with OutputSet() as outputs:
        outputs.create(first).write(b"new first")
        outputs.create(last, last=True).write(b"new last")
        with pytest.raises(OutputError):
            outputs.commit()
    assert first.read_bytes() == b"new first" and not last.exists()
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("fails", [False, True], ids=["commit", "then-a-rename-fails"])
def test_a_failure_keeping_the_replaced_file_aside_is_no_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    """Any error making the second name (EIO here, not only "no hard links") leaves the replace
    to go on as a plain os.replace would: it failed the commit of a --force run. The replaced
    file cannot then be put back: if a later rename fails, that member stays, complete, and the
    rest is withdrawn (as without hard links)."""
    first, last = tmp_path / "first.bin", tmp_path / "last.bin"
    first.write_bytes(b"old")
    atomic.preflight([first], [], force=True)
    atomic.preflight([last], [], force=not fails)

    def eio(*args: object, **kw: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "link", eio)
    if fails:
        _fail_the_last_rename(monkeypatch, "eio")
    with OutputSet() as outputs:
        outputs.create(first).write(b"new first")
        outputs.create(last, last=True).write(b"new last")
        if fails:
            with pytest.raises(OutputError, match=f"^{last}: cannot rename into place"):
                outputs.commit()
        else:
            outputs.commit()
    assert first.read_bytes() == b"new first"
    assert (last.read_bytes() if last.exists() else None) == (None if fails else b"new last")
    assert leftovers(tmp_path) == []


def test_a_second_name_that_cannot_be_locked_holds_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where flock is refused the second name is unlocked, as documented, and no descriptor of
    it is kept open (one was, unlocked, while the docstring said it was locked)."""
    (tmp_path / "a.bin").write_bytes(b"old")

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(commit.fcntl, "flock", no_locks)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        aside, there = commit.keep_aside(dir_fd, "a.bin", "00aa")
        assert there and aside is not None and aside.lock_fd is None
        assert (tmp_path / aside.name).read_bytes() == b"old"
        os.unlink(aside.name, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def test_a_replaced_file_that_cannot_be_put_back_is_kept_outside_any_cleanup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A withdrawn commit that cannot put a replaced file back (the rename fails) leaves it under
    a name no cleanup takes, and the error says where: it was left under its second name, a
    temp's, which the next run's cleanup deleted (the user's only copy)."""
    first, last = tmp_path / "first.bin", tmp_path / "last.bin"
    first.write_bytes(b"the user's old file")
    atomic.preflight([first], [], force=True)
    atomic.preflight([last], [], force=False)
    _fail_the_last_rename(monkeypatch, "eio")
    real, calls = os.replace, []

    def replace(src: str, dst: str, **kw: object) -> None:
        calls.append(dst)
        if dst == "first.bin" and len(calls) > 1:  # the second: putting the old file back
            raise OSError(errno.EIO, os.strerror(errno.EIO), dst)
        real(src, dst, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", replace)
    with OutputSet() as outputs:
        outputs.create(first).write(b"new first")
        outputs.create(last, last=True).write(b"new last")
        with pytest.raises(OutputError) as refused:
            outputs.commit()
    monkeypatch.undo()
    atomic.remove_stale_temps(tmp_path)  # the next run in that directory
    kept = [p for p in tmp_path.iterdir() if p.read_bytes() == b"the user's old file"]
    assert len(kept) == 1, sorted(os.listdir(tmp_path))
    message = str(refused.value)
    assert "\n" not in message and f"kept as {kept[0]}" in message, message
    assert kept[0].name.startswith("first.bin.qtool-kept-")
    assert leftovers(tmp_path) == []
