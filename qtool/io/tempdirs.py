"""Temp directories of killed runs: `.<OUT>.qtool-tmp-<pid>-<random>/` (an export being built)
and `.<OUT>.qtool-old-<pid>-<random>/` (a previous export moved aside during a `--force`
replace without RENAME_EXCHANGE), removed exactly as temp files are (atomic.remove_stale_temps
calls this for each directory it finds):

- where locks are enforced (probed once per directory, see atomic._locks_enforced), a
  directory is taken only when its lock can be taken at once: a live run holds the lock of its
  temp directory from its creation to its end, and the kernel drops it when the run dies;
- where they are not (some NFS and FUSE mounts accept flock and enforce nothing), or where
  flock on a directory fails, only a directory in which nothing changed for `max_age` seconds
  (its newest mtime, files inside included: a live run keeps writing) is taken.

An old export is renamed back to OUT when OUT is missing; otherwise it is removed. Names are
relative to the parent's descriptor; links are never followed. Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from qtool.io import renames

TEMP_DIR_RE = re.compile(r"\.(.+)\.qtool-(tmp|old)-(\d+)-[0-9a-f]+\Z", re.DOTALL)
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)  # what a held lock answers


def remove_if_dead(parent_fd: int, name: str, *, locks_work: bool, max_age: float) -> bool:
    """Remove (or, an old export, restore) the temp directory `name` of `parent_fd` when no
    live run holds it (see the module docstring); True when it was taken."""
    match = TEMP_DIR_RE.match(name)
    dfd = open_dir_at(parent_fd, name)
    if match is None or dfd < 0:
        return False
    try:
        if not _is_dead(dfd, locks_work, max_age) or not same_at(dfd, parent_fd, name):
            return False
        final, kind = match.group(1), match.group(2)
        if kind == "old" and lstat_at(parent_fd, final) is None:
            with contextlib.suppress(OSError):
                renames.rename_noreplace(parent_fd, name, final)
                return True
        rmtree_at(parent_fd, name)
        return True
    finally:
        os.close(dfd)


def _is_dead(dfd: int, locks_work: bool, max_age: float) -> bool:
    if locks_work:
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as err:
            if err.errno in _BUSY:
                return False  # a live run holds it
            # flock refused on directories here: fall back to the age rule
    return time.time() - newest_mtime(dfd) >= max_age


def newest_mtime(dfd: int) -> float:
    """The newest mtime of the directory `dfd` and everything below it (links not followed)."""
    newest = os.fstat(dfd).st_mtime
    with contextlib.suppress(OSError):
        for _root, dirs, files, rootfd in os.fwalk(".", dir_fd=dfd):
            for entry in (*dirs, *files):
                st = lstat_at(rootfd, entry)
                if st is not None:
                    newest = max(newest, st.st_mtime)
    return newest


def lock_dir(fd: int, wait_s: float | None = None) -> bool:
    """Lock a directory (a temp one for this run's life, or an old export being replaced);
    False where this filesystem cannot. With `wait_s`, TimeoutError once it was held by
    someone else that long (never a silent hang behind a stopped process)."""
    if wait_s is None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            return False
        return True
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as err:
            if err.errno not in _BUSY:
                return False
        if time.monotonic() >= deadline:
            raise TimeoutError(f"locked by another process for over {wait_s:g} s")
        time.sleep(0.05)


def same_at(fd: int, parent_fd: int, name: str) -> bool:
    """Whether `name` in `parent_fd` is still the file `fd` has open."""
    st = lstat_at(parent_fd, name)
    return st is not None and os.path.samestat(os.fstat(fd), st)


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def is_dir_at(dir_fd: int, name: str) -> bool:
    st = lstat_at(dir_fd, name)
    return st is not None and stat.S_ISDIR(st.st_mode)


def open_dir_at(dir_fd: int, name: str) -> int:
    """A descriptor on the directory `name` (never through a link), or -1."""
    try:
        return os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError:
        return -1


def rmtree_at(dir_fd: int, name: str) -> None:
    """Remove the directory `name` and all it holds, never following a link out of it."""
    with contextlib.suppress(OSError):
        shutil.rmtree(name, dir_fd=dir_fd)


# ---------------------------------------------------------------- private scratch directories

_SCRATCH_RE = re.compile(r"^qtool-(?P<kind>[a-z]+)-[a-z0-9_]{8}$")  # tempfile.mkdtemp's names


@contextlib.contextmanager
def private_scratch(kind: str) -> Iterator[Path]:
    """A new directory only this user can enter (0700) in the system's temp directory, named
    `qtool-KIND-XXXXXXXX`, locked for its life and removed on exit. A SIGKILL skips that
    removal, so each new one first removes the user's own dead ones of the same kind (a lock
    nobody holds, at least SCRATCH_GRACE_S old; never another user's, never through a link).
    OSError when none can be made."""
    parent = tempfile.gettempdir()
    _refuse_shared_parent(parent)
    _remove_dead_scratch(parent, kind)
    scratch = Path(tempfile.mkdtemp(prefix=f"qtool-{kind}-", dir=parent))
    fd = -1
    try:
        fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        lock_dir(fd)
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if fd >= 0:
            os.close(fd)


def _refuse_shared_parent(parent: str) -> None:
    """OSError when another user could rename the scratch directory away and put theirs in its
    place (callers reopen files in it by path): `parent` writable by group or others without
    the sticky bit, or owned by another user than this one or root."""
    st = os.stat(parent)
    shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX
    if shared or st.st_uid not in (os.getuid(), 0):
        raise OSError(
            f"the temporary directory {parent} is writable by other users without the sticky "
            "bit, or owned by another user; set TMPDIR to a directory only you can write"
        )


SCRATCH_GRACE_S = 60.0
"""A scratch directory younger than this is never taken for a dead run's: another run may have
made it and not locked it yet."""


def _remove_dead_scratch(parent: str, kind: str) -> None:
    try:
        pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        for name in os.listdir(pfd):
            match = _SCRATCH_RE.match(name)
            if match is None or match["kind"] != kind:
                continue
            st = lstat_at(pfd, name)
            if st is None or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            if time.time() - st.st_mtime < SCRATCH_GRACE_S:
                continue
            dfd = open_dir_at(pfd, name)
            if dfd < 0:
                continue
            try:
                fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live run: busy
                if same_at(dfd, pfd, name):
                    rmtree_at(pfd, name)
            except OSError:
                pass
            finally:
                os.close(dfd)
    except OSError:
        pass
    finally:
        os.close(pfd)
