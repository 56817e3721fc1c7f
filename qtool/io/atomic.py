"""Output files that appear under their final names complete, or not at all.

Each output is written to `.<name>.qtool-tmp-<pid>-<random>` in its target directory (O_EXCL,
mode 0o666 & ~umask), flushed and fsynced, then renamed into place, and the directories are
fsynced. Files created with `last=True` (the file a user opens: the quantized file, an index)
are renamed after all the others, so whenever one exists under its final name, everything it
refers to is already in place. On any exception every temp file is removed and no final name is
touched. A SIGKILL can leave temp files; they never look like output, and the next run in that
directory removes those that no live run holds (remove_stale_temps): every temp is locked (flock)
from its creation until after its rename, and the kernel drops the lock of a dead process in any
PID namespace.
A file a `force` commit replaces keeps a second name until the commit is done; after a kill the
next run keeps it as `<name>.qtool-kept-<time>` when the commit was cut short
(remove_stale_temps).

Where the run's preflight had no `force`, the rename is renameat2(RENAME_NOREPLACE) (or link()
+ unlink()): a file that appeared at an output name meanwhile (another run, another program) is
kept, and the commit fails and takes back the renames it had made. With `force` (or for a name
no preflight checked) it is os.replace. Temps are created, renamed and removed through a
descriptor of their directory opened when the first was made there; the commit first checks
that the output's directory path still leads to that directory.

`preflight` is the one check every output of every command passes before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import signal
import stat
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from qtool.errors import OutputError, UsageError
from qtool.io import tempdirs
from qtool.io.commit import (
    ASIDE_RE,
    Placed,
    Temp,
    exists_at,
    keep_as_kept,
    keep_aside,
    rename_noreplace,
    saying_kept,
    withdraw,
)
from qtool.io.mounts import is_mount_point
from qtool.io.safeopen import file_kind

_TEMP_RE = re.compile(r"\..+\.qtool-tmp-(\d+-[0-9a-f]+)\Z", re.DOTALL)  # names may hold \n
STALE_AGE_S = 24 * 3600  # where locks are not enforced, only temps this old are removed

FileId = tuple[int, int]  # (st_dev, st_ino): what a file is, whatever path names it


class OutputSet:
    """Context manager collecting temp files; `commit()` renames them, leaving aborts clean."""

    def __init__(self) -> None:
        self._files: list[tuple[Temp, Path, BinaryIO, bool]] = []  # (temp, final, handle, last)
        self._temps: list[Temp] = []  # every temp, listed before it is created
        self._dirs: dict[Path, int] = {}  # each final's directory, opened once
        self._keep_free: set[Path] = set()  # finals whose preflight had no force
        self._committed = False
        # in every temp's and second name's name: a cleanup after a kill tells this set's from
        # another run's, so it knows whether this set's commit was cut short (remove_stale_temps)
        self._token = secrets.token_hex(4)

    def __enter__(self) -> OutputSet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._committed:
            self.abort()

    def create(self, final: Path, *, last: bool = False) -> BinaryIO:
        """Open a new locked temp file that will become `final` on commit (after the others if
        last)."""
        dir_fd = self._dir_fd(final)
        key = _place_key(final)
        if key in _KEEP_FREE:  # checked free without force: this set's commit keeps it free
            _KEEP_FREE.discard(key)
            self._keep_free.add(final)
        while True:
            temp = Temp(dir_fd, f".{final.name}.qtool-tmp-{os.getpid()}-{self._token}")
            self._temps.append(temp)  # first: a signal right after the open still removes it
            try:
                fd = os.open(
                    temp.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666,
                    dir_fd=dir_fd,
                )  # fmt: skip
            except OSError as err:
                self._temps.pop()
                raise OutputError(
                    final, f"cannot create a file in {final.parent}: {describe_os_error(err)}"
                ) from err
            if _lock_own_temp(fd, temp):
                break
            self._temps.pop()  # a cleanup took it before the lock: the name is gone, retry
        handle = os.fdopen(fd, "wb")
        self._files.append((temp, final, handle, last))
        return handle

    def _dir_fd(self, final: Path) -> int:
        if (fd := self._dirs.get(final.parent)) is not None:
            return fd
        try:
            fd = _open_dir(final.parent)
        except OSError as err:
            raise OutputError(
                final, f"cannot create a file in {final.parent}: {describe_os_error(err)}"
            ) from err
        self._dirs[final.parent] = fd
        return fd

    def commit(self) -> None:
        """fsync every file, rename each into place in order, fsync the directories. Each temp
        stays locked until it is renamed, so no other run's cleanup can take it. Where the
        preflight had no `force`, the rename refuses atomically to replace what appeared since
        (OutputError naming it). When any rename fails, the renames this commit made before are
        taken back: a member that replaced nothing is removed, one that replaced a file puts
        that file back (kept under a second name, a hard link, until the commit is done; where
        no hard link can be made it cannot be, and the member is left in its place)."""
        for _temp, final, handle, _last in self._files:
            try:
                handle.flush()
                os.fsync(handle.fileno())
            except OSError as err:
                raise OutputError(final, f"cannot write: {describe_os_error(err)}") from err
        ordered = sorted(self._files, key=lambda f: f[3])  # stable: creation order, last ones last
        replaceable = {final: final not in self._keep_free for _, final, _, _ in ordered}
        for temp, final, _, _ in ordered:
            _refuse_special(final)  # appeared since the preflight: replace nothing but files
            _refuse_moved(temp.dir_fd, final)
            if not replaceable[final] and exists_at(temp.dir_fd, final.name):
                raise _appeared(final)
        placed: list[Placed] = []  # each member from the moment its rename is attempted
        current = ordered[0][1] if ordered else Path()
        try:
            for temp, final, handle, _ in ordered:
                current = final
                aside, there = (None, False)
                if replaceable[final]:
                    aside, there = keep_aside(temp.dir_fd, final.name, self._token)
                placed.append(Placed(temp, final, handle, aside, there and aside is None))
                if replaceable[final]:
                    os.replace(temp.name, final.name, src_dir_fd=temp.dir_fd,
                               dst_dir_fd=temp.dir_fd)  # fmt: skip
                else:
                    ours = os.fstat(handle.fileno())
                    rename_noreplace(temp.dir_fd, temp.name, final.name, ours)
        except BaseException as err:
            kept = withdraw(placed)
            if isinstance(err, FileExistsError):
                raise saying_kept(_appeared(current), kept) from err
            if isinstance(err, OSError):
                raise saying_kept(OutputError(
                    current, f"cannot rename into place: {describe_os_error(err)}"
                ), kept) from err  # fmt: skip
            raise
        for member in placed:
            member.drop_aside()
        self._committed = True
        for _, _, handle, _ in self._files:
            with contextlib.suppress(OSError):
                handle.close()
        for fd in self._dirs.values():
            with contextlib.suppress(OSError):
                os.fsync(fd)
        self._close_dirs()

    def abort(self) -> None:
        for temp in self._temps:
            with contextlib.suppress(OSError):
                os.unlink(temp.name, dir_fd=temp.dir_fd)
        for _, _, handle, _ in self._files:
            with contextlib.suppress(OSError):
                handle.close()
        self._files.clear()
        self._temps.clear()
        self._close_dirs()

    def _close_dirs(self) -> None:
        for fd in self._dirs.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._dirs.clear()


# Outputs whose preflight found their name free and had no `force`, by (directory, name): the
# OutputSet that creates one takes it, and its commit must find that name still free. A
# preflight with `force` takes it back; a name no preflight reserved (a library caller, a
# scratch file) is replaced at the commit, as os.replace does. Within one_command() they are
# that command's alone; outside any, the process's.
_KEEP_FREE: set[tuple[object, str]] = set()


@contextlib.contextmanager
def one_command() -> Iterator[None]:
    """The reservations of one command: it starts with none (whatever an earlier command in
    this process preflighted and never wrote, a failed or dry run, is not seen: a later
    command's set would otherwise refuse to replace a file at that name, or at a name in a new
    directory that reuses the old one's inode), and those it made end with it."""
    outer = set(_KEEP_FREE)
    _KEEP_FREE.clear()
    try:
        yield
    finally:
        _KEEP_FREE.clear()
        _KEEP_FREE.update(outer)


def _open_dir(directory: Path) -> int:
    """A descriptor of `directory` for the *at() calls. A directory one may write into and
    search but not read (mode 0333, 1733: a drop box) cannot be opened O_RDONLY; O_PATH needs
    no permission on it and serves openat, renameat2, linkat, unlinkat and fstat alike (not
    fsync: such a directory's entries are not fsynced)."""
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except PermissionError:
        if not hasattr(os, "O_PATH"):
            raise
        return os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def _place_key(path: Path) -> tuple[object, str]:
    return (file_id(path.parent) or os.path.abspath(path.parent), path.name)


def _appeared(final: Path) -> OutputError:
    return OutputError(
        final,
        "appeared while this run was writing; nothing was replaced and this run's output was "
        "not kept: run again to replace it",
        hint="force",
    )


def _refuse_moved(dir_fd: int, final: Path) -> None:
    """The temps were made in the directory `final.parent` named then; if that path now leads
    elsewhere (the directory moved, or swapped for a link), the output would not be where the
    user looks for it."""
    try:
        same = os.path.samestat(os.stat(final.parent), os.fstat(dir_fd))
    except OSError:
        same = False
    if not same:
        raise OutputError(
            final,
            f"its directory {final.parent} was moved or replaced while this run wrote into it; "
            "nothing was written: run again",
        )


def _lock_own_temp(fd: int, temp: Temp) -> bool:
    """Lock a fresh temp; False (and the fd closed) if a cleanup removed it before the lock."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits only for a cleanup that is unlinking it
    try:
        st = os.stat(temp.name, dir_fd=temp.dir_fd, follow_symlinks=False)
        same = os.path.samestat(os.fstat(fd), st)
    except OSError:
        same = False
    if not same:
        os.close(fd)
    return same


def write_file(final: Path, data: bytes) -> None:
    """Write one small output atomically (temp in the target directory, fsync, rename), after
    removing what killed runs left in that directory."""
    remove_stale_temps(final.parent)
    with OutputSet() as outputs:
        outputs.create(final).write(data)
        outputs.commit()


def remove_stale_temps(directory: Path) -> int:
    """Delete the temp files and temp directories left in `directory` by qtool runs that were
    killed (an old export a killed `--force` had moved aside is put back, a file a cut-short
    commit replaced is kept); return how many names were settled.

    A temp is stale when its lock can be taken: a live run, in any PID namespace, holds the lock
    of each of its temps until the commit (of its temp directory until its end). Where locks are
    not enforced (some network filesystems), only temps untouched for STALE_AGE_S are removed
    (see tempdirs.py). A killed commit's second name of a file it replaced is kept when the
    commit was cut short (see _settle_aside), so it is seen before the temps, and a temp is
    left while a second name of its set is still there (locked by someone, or not renamable):
    its presence is what says the commit was cut short."""
    names = sorted(_temp_names(directory), key=lambda n: ASIDE_RE.match(n) is None)
    if not names:
        return 0
    locks_work = _locks_enforced(directory)
    removed = 0
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in names:
                if tempdirs.is_dir_at(fd, name):
                    gone = tempdirs.remove_if_dead(
                        fd, name, locks_work=locks_work, max_age=STALE_AGE_S
                    )
                elif ASIDE_RE.match(name):
                    gone = _settle_aside(fd, directory, name, names, locks_work)
                else:
                    temp = _TEMP_RE.match(name)
                    gone = (
                        temp is not None
                        and not _set_has_aside(fd, names, temp[1])
                        and _remove_if_stale(directory / name, locks_work)
                    )
                removed += gone
        finally:
            os.close(fd)
    return removed


def _set_has_aside(dir_fd: int, names: Sequence[str], pid_token: str) -> bool:
    """Whether a second name of the output set `pid_token` is still in the directory (a
    regular file: one of a replaced symlink is never settled, and must not hold the temps)."""
    for name in names:
        match = ASIDE_RE.match(name)
        if match and match[2] == pid_token:
            st = tempdirs.lstat_at(dir_fd, name)
            if st is not None and stat.S_ISREG(st.st_mode):
                return True
    return False


def _temp_names(directory: Path) -> list[str]:
    """Names in `directory` that look like a qtool temp file or temp directory."""
    try:
        return [n for n in os.listdir(directory) if tempdirs.TEMP_DIR_RE.match(n)]
    except OSError:
        return []


def _remove_if_stale(path: Path, locks_work: bool) -> bool:
    fd = _open_if_stale(path, locks_work)
    if fd is None:
        return False
    try:
        os.unlink(path)  # before the lock is dropped: a racing creator sees its temp gone
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _settle_aside(dir_fd: int, directory: Path, name: str, names: Sequence[str],
                  locks_work: bool) -> bool:  # fmt: skip
    """A killed run's second name of a file its commit replaced. Removed when the set left no
    temp (the run died after its renames: its files are in place) or the final name holds
    that very file; kept as `NAME.qtool-kept-<time>` when a temp of the set is left (the
    commit was cut short: the old quantized file's own sidecar, say, which the new one
    replaced). Never renamed over the final name: what is there by now (a newer run's file, a
    name another user planted) is not known to be the killed run's. Left alone while any temp
    of that set is held by a live run."""
    match = ASIDE_RE.match(name)
    assert match is not None
    run = f".qtool-tmp-{match[2]}"
    fd = _open_if_stale(directory / name, locks_work)
    if fd is None:
        return False
    try:
        left = [n for n in names if n.endswith(run)]
        if not all(_is_stale(directory / n, locks_work) for n in left):
            return False  # the run is alive (its second name could not be locked) or raced
        try:
            in_place = os.path.samestat(
                os.fstat(fd), os.stat(match[1], dir_fd=dir_fd, follow_symlinks=False)
            )
        except FileNotFoundError:
            in_place = False
        if left and not in_place:
            return keep_as_kept(dir_fd, name, match[1]) != name  # else tried again next run
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _open_if_stale(path: Path, locks_work: bool) -> int | None:
    """A descriptor of `path` when it is a regular file no live run holds: its lock taken (held
    until the descriptor is closed), or, where locks are not enforced, untouched for
    STALE_AGE_S; else None."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None  # never opened: a device node planted under a temp's name
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        # the later of mtime and ctime: a commit's second name of a replaced file (a hard
        # link) keeps that file's old mtime, while its ctime is the link's
        if (
            stat.S_ISREG(st.st_mode)
            and (locks_work or time.time() - max(st.st_mtime, st.st_ctime) >= STALE_AGE_S)
            and (not locks_work or _try_lock(fd))
            and os.path.samestat(st, os.stat(path, follow_symlinks=False))
        ):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _is_stale(path: Path, locks_work: bool) -> bool:
    fd = _open_if_stale(path, locks_work)
    if fd is not None:
        os.close(fd)
    return fd is not None


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _locks_enforced(directory: Path) -> bool:
    """Whether two opens of one file in `directory` exclude each other's flock here."""
    with _interrupts_held():
        return _probe_locks(directory)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends: an interrupt that lands between creating the
    probe file and recording it would otherwise leave the probe behind."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _probe_locks(directory: Path) -> bool:
    probe = directory / f".lockprobe.qtool-tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fds: list[int] = []
    try:
        fds.append(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        fds.append(os.open(probe, os.O_RDONLY | os.O_NOFOLLOW))
        return _try_lock(fds[0]) and not _try_lock(fds[1])
    except OSError:
        return False
    finally:
        if fds:
            with contextlib.suppress(OSError):
                os.unlink(probe)
        for fd in fds:
            os.close(fd)


def describe_os_error(err: OSError) -> str:
    """What an OS error means for an output, with what to do about it."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on device; free some space or write elsewhere with -o"
    if err.errno == errno.EFBIG:
        return "file too large for this filesystem or ulimit; write elsewhere with -o"
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission denied; choose a writable location with -o"
    return f"{err.strerror or err}; check the output location"


def file_id(path: Path) -> FileId | None:
    """(device, inode) of what `path` names after symlinks; None if it names nothing."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino)


def preflight(
    outputs: Sequence[Path],
    protected: Iterable[Path],
    *,
    force: bool,
    needed_bytes: int = 0,
) -> None:
    """Before anything is written: refuse outputs that collide with each other, that are a
    protected file (an input, its sidecar or a companion: compared by device and inode), that
    exist without `force`, that are anything but a regular file, or whose directory is missing,
    read-only or (for the first output) short of `needed_bytes`. Without `force`, the commit
    of these outputs replaces nothing (whatever appeared there meanwhile)."""
    guarded = {i: p for p in protected if (i := file_id(p)) is not None}
    _KEEP_FREE.difference_update(_place_key(out) for out in outputs)
    _refuse_collisions(outputs)
    for out in outputs:
        _check_output(out, guarded, force)
    if outputs and needed_bytes:
        _check_space(outputs[0], needed_bytes)
    if not force:  # anything the commit finds there appeared meanwhile: never replaced
        _KEEP_FREE.update(_place_key(out) for out in outputs)


def _check_output(out: Path, guarded: dict[FileId, Path], force: bool) -> None:
    if not out.parent.is_dir():
        raise OutputError(out, f"directory {out.parent} does not exist; create it first")
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        st = None
    except OSError as err:
        raise OutputError(out, f"cannot check this output: {describe_os_error(err)}") from err
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputError(out, "is a directory; give a file name")
    target = file_id(out)
    if target is not None and target in guarded:
        raise OutputError(
            out, f"would overwrite the input {guarded[target]}; choose another output path"
        )
    if st is not None:
        _refuse_special(out)
        if is_mount_point(out):  # a bind-mounted file: renaming onto it fails with EBUSY
            raise OutputError(
                out,
                "is a mount point; qtool writes a new file and renames it into place, which a "
                "mount point cannot take: write elsewhere",
            )
        if not force:
            raise OutputError(out, "already exists; it is replaced only when asked", hint="force")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise OutputError(out, f"directory {out.parent} is not writable; choose another location")


def _refuse_special(out: Path) -> None:
    """Only a regular file (or a symlink to one, which is replaced, not followed) or nothing
    may stand where an output goes: never a device, FIFO, socket or directory."""
    try:
        st = os.lstat(out)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(out)
        except OSError:
            return  # a dangling link: replacing it loses nothing
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(
            out,
            f"is {file_kind(st.st_mode)}, not a regular file; qtool replaces only regular files",
        )


def _refuse_collisions(outputs: Sequence[Path]) -> None:
    """Two outputs of one run must never land on the same name (or the same existing file)."""
    seen: dict[object, Path] = {}
    for out in outputs:
        keys: list[object] = [(file_id(out.parent) or os.path.abspath(out.parent), out.name)]
        if (existing := file_id(out)) is not None:
            keys.append(existing)
        for key in keys:
            if key in seen:
                raise OutputError(
                    out,
                    f"two outputs of this run would both be written here (also {seen[key]}); "
                    "rename an input or choose other output paths",
                )
            seen[key] = out


def _check_space(out: Path, needed: int) -> None:
    free = shutil.disk_usage(out.parent).free
    if needed > free:
        raise OutputError(
            out,
            f"needs about {needed:,} bytes but {out.parent} has {free:,} free; "
            "free some space or write elsewhere with -o",
        )


# Extensions of files people name outputs after; any other suffix (`model.int8`) is part of a name.
_KNOWN_EXTENSIONS = (".safetensors", ".pt", ".pth", ".bin", ".gguf", ".npz", ".npy", ".onnx",
                     ".ckpt", ".json", ".png", ".jpg", ".svg", ".pdf")  # fmt: skip


def resolve_output(
    out: Path | None, default: Path, accepted: tuple[str, ...], what: str, flag: str = "-o"
) -> Path:
    """The file to write: `default` when `out` is None, `out` when its extension is one of
    `accepted`, the default name inside `out` when it is an existing directory of another
    name, and a UsageError for any other name."""
    if out is None:
        return default
    if out.suffix.lower() in accepted:  # even a directory named so: refused later, clearly
        return out
    if out.is_dir():
        return out / default.name
    known = out.suffix.lower() in _KNOWN_EXTENSIONS
    stem = out.stem if known else out.name
    has = f"ends in {out.suffix}" if known else "has no file extension"
    raise UsageError(
        out,
        f"{what} writes {' or '.join(accepted)} files but this name {has}; "
        f"use e.g. {flag} {out.with_name(stem + accepted[0])} (or an existing directory)",
    )
