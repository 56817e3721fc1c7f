"""The renames of a commit (io/atomic.py OutputSet.commit), and taking them back.

A member renamed with os.replace over a file first gives that file a second name (a hard link,
locked where flock works), so a commit that fails at a later rename can put it back; a member
that must not replace anything is renamed with renameat2(RENAME_NOREPLACE) or link() + unlink().
`withdraw` takes back the renames of a failed commit, last first.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from qtool.errors import OutputError
from qtool.io import renames


@dataclass(frozen=True)
class Temp:
    """A temp file by its directory's descriptor (opened when the first temp there was made) and
    its name: removing or renaming it never follows a path that was moved or swapped meanwhile."""

    dir_fd: int
    name: str


def exists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EXDEV)


def rename_noreplace(dir_fd: int, old: str, new: str, ours: os.stat_result) -> None:
    """Rename file `old` (whose stat is `ours`) to `new` in `dir_fd` unless `new` exists
    (FileExistsError): with renameat2(RENAME_NOREPLACE), else link() then unlink(), which fails
    on an existing name too. Where neither works (a filesystem without hard links), the check
    just before os.replace is all there is: a file created in between is replaced. An EEXIST
    for a name that holds our own file is our call's success: NFS retransmits a rename or
    link() whose reply was lost, and the server answers the retry with EEXIST."""
    try:
        if renames.renameat2(dir_fd, old, new, renames.RENAME_NOREPLACE):
            return
    except FileExistsError:
        if not _holds(dir_fd, new, ours):
            raise
        return
    try:
        os.link(old, new, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        if not _holds(dir_fd, new, ours):
            raise
    except OSError as err:
        if err.errno not in NO_LINKS:
            raise
        if exists_at(dir_fd, new):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), new) from err
        os.replace(old, new, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return
    with contextlib.suppress(FileNotFoundError):  # (a retried unlink whose first one worked)
        os.unlink(old, dir_fd=dir_fd)


def _holds(dir_fd: int, name: str, ours: os.stat_result) -> bool:
    """Whether `name` in `dir_fd` is the file `ours` is the stat of (not a link to it)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return os.path.samestat(st, ours)


@dataclass
class Placed:
    """A member of a commit whose rename was attempted, and the second name (a hard link,
    locked where it can be: no cleanup takes it) of the file its final name held before."""

    temp: Temp
    final: Path
    handle: BinaryIO
    aside: _Aside | None
    unkept: bool  # it replaced a file that could not be kept aside (no hard links)

    def drop_aside(self) -> None:
        if self.aside is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.aside.name, dir_fd=self.temp.dir_fd)
            self.aside.release()
            self.aside = None


@dataclass
class _Aside:
    name: str
    lock_fd: int | None

    def release(self) -> None:
        if self.lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.lock_fd)
            self.lock_fd = None


def aside_name(name: str, token: str) -> str:
    """The second name of the file at `name` that a commit of the set `token` replaces: a
    killed run's is kept or removed by the next run (atomic.remove_stale_temps)."""
    return f".{name}.qtool-old-{os.getpid()}-{token}"


ASIDE_RE = re.compile(r"\.(.+)\.qtool-old-(\d+-[0-9a-f]+)\Z", re.DOTALL)  # (final, pid-token)


def keep_aside(dir_fd: int, name: str, token: str) -> tuple[_Aside | None, bool]:
    """A second name (aside_name) for the file at `name` that os.replace is about to replace
    (None when nothing is there or no hard link can be made: the replace goes on, as a plain
    os.replace would, and the file cannot be put back), and whether anything is there. The file
    is locked first where it can be opened and locked (a symlink cannot be opened, nor cleaned;
    where locks are refused the second name is unlocked), so another run's cleanup leaves the
    second name alone."""
    aside = _Aside(aside_name(name, token), _lock(dir_fd, name))
    try:
        os.link(name, aside.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except OSError as err:
        aside.release()
        if isinstance(err, FileNotFoundError):
            return None, False
        try:
            return None, exists_at(dir_fd, name)
        except OSError:
            return None, True  # unknown: taken as there, so a withdrawal never removes it
    return aside, True


def _lock(dir_fd: int, name: str) -> int | None:
    """A descriptor of the file `name` holding its lock (flock), or None where it cannot be
    opened or locked."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)  # fmt: skip
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def withdraw(placed: Sequence[Placed]) -> list[str]:
    """Take back the renames of a failed commit, last first, so none of the set is left: where
    a final name still holds our file, the file it replaced is put back (or, if it replaced
    nothing, the name removed; one that replaced what could not be kept aside stays: removing
    it would lose both). A replaced file that cannot be put back is kept under a name no
    cleanup takes; returned: where each such file is, for the error."""
    kept: list[str] = []
    for member in reversed(placed):
        dir_fd, name = member.temp.dir_fd, member.final.name
        try:
            ours = os.path.samestat(os.stat(name, dir_fd=dir_fd, follow_symlinks=False),
                                    os.fstat(member.handle.fileno()))  # fmt: skip
        except OSError:
            ours = False
        try:
            if ours and member.aside is None and not member.unkept:
                os.unlink(name, dir_fd=dir_fd)
            elif ours and member.aside is not None:
                os.replace(member.aside.name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError:
            if member.aside is not None:
                kept.append(f"{member.final.name}'s previous file could not be put back and is "
                            f"kept as {member.final.parent / _keep_outside(member)}")  # fmt: skip
            continue
        member.drop_aside()  # (gone if put back; else the final name still holds that file)
    return kept


def _keep_outside(member: Placed) -> str:
    """The name the replaced file of `member` is kept under once it cannot be put back
    (keep_as_kept)."""
    assert member.aside is not None
    kept = keep_as_kept(member.temp.dir_fd, member.aside.name, member.final.name)
    member.aside.release()
    member.aside = None
    return kept


def keep_as_kept(dir_fd: int, aside: str, final_name: str) -> str:
    """Rename the second name `aside` of a replaced file to `NAME.qtool-kept-<UTC time>`, which
    no cleanup takes and nothing is renamed over; returns the name the file has after it
    (`aside` where even this rename fails, a name too long for the filesystem say)."""
    when = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    try:
        ours = os.stat(aside, dir_fd=dir_fd, follow_symlinks=False)
        for n in range(100):  # a random suffix: names planted ahead cannot use up the tries
            name = f"{final_name}.qtool-kept-{when}" + (f"-{secrets.token_hex(4)}" if n else "")
            with contextlib.suppress(FileExistsError):
                rename_noreplace(dir_fd, aside, name, ours)
                return name
    except OSError:
        pass
    return aside


def saying_kept(error: OutputError, kept: list[str]) -> OutputError:
    """`error`, its message naming where the files a withdrawn commit could not put back are."""
    if kept:
        error.message = "; ".join([error.message, *kept])
        error.args = (error.message,)
    return error
