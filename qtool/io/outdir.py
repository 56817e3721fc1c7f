"""Output directories that appear whole, never replace what they must not, and never lose data.

`DirTransaction(out, force=..., protected=...)`: `check()` before any work, then `with tx as
temp:` builds in `.<name>.qtool-tmp-<pid>-<random>/` beside `out`, locked (flock) for its whole
life so a later run's cleanup never takes it (where the filesystem refuses flock on a
directory, it goes unlocked and cleanups there fall back to an age rule: tempdirs.py). Entering
removes what killed runs left beside `out` (atomic.remove_stale_temps: files and directories).
On success the transaction writes a manifest of what it built (manifest.py: each file's size
and a fingerprint), then publishes in one atomic step without replacing anything unexpected:

- `out` missing (or an empty directory): `renameat2(RENAME_NOREPLACE)` (fallback: an exclusive
  mkdir then a rename over that empty placeholder). A directory that appeared meanwhile is never
  replaced: the run fails, naming `out`, and leaves nothing.
- `out` a previous qtool export and `--force`: `out` is locked, checked again (every file is one
  its manifest lists, unchanged), and swapped with the temp directory by
  `renameat2(RENAME_EXCHANGE)`; the old export, now under the locked temp name, is checked once
  more (swapped back if anything else appeared) and removed. Without RENAME_EXCHANGE the old
  one is moved aside to `.<name>.qtool-old-<pid>-<random>` first and restored if the new one
  cannot take its place; a run killed in between leaves it there, locked by nobody, and the next
  run's cleanup renames it back when `out` is missing.
- anything else (files qtool did not write, a symlink, a file, a mount point, `-o .`) is
  refused in `check()` (outcheck.py), before any work, naming up to three of the files that
  would be lost.

Every error, the final renames' included, names `out`, never the temp directory. Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

from qtool.errors import OutputError, QtoolError
from qtool.io import renames
from qtool.io import tempdirs as td
from qtool.io.atomic import describe_os_error, remove_stale_temps
from qtool.io.manifest import write_manifest
from qtool.io.outcheck import check_out_dir, refuse_nesting, refuse_unknown_files

__all__ = ["DirTransaction", "check_out_dir", "refuse_nesting", "refuse_unknown_files",
           "remove_stale_dirs", "transaction"]  # fmt: skip

LOCK_WAIT_S = 120.0  # how long --force waits for another run replacing the same -o


class DirTransaction:
    """Build a directory beside `out` and publish it as `out` (see the module docstring)."""

    def __init__(self, out: Path, *, force: bool, protected: Sequence[Path] = ()) -> None:
        self.out = out
        self.force = force
        self.protected = list(protected)
        self.temp = out.parent / f".{out.name}.qtool-tmp-{os.getpid()}-{secrets.token_hex(4)}"
        self._parent_fd = -1
        self._lock_fd = -1
        self._keep_temp = False  # the temp name holds data that is not ours to remove

    # ------------------------------------------------------------ before any work

    def check(self) -> None:
        """Refuse, before any work, an `out` this run may not write (see check_out_dir)."""
        check_out_dir(self.out, self.protected, self.force)

    # ------------------------------------------------------------ the build

    def __enter__(self) -> Path:
        self.check()
        parent = self.out.parent
        try:
            self._parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except PermissionError as err:
            if os.access(parent, os.W_OK | os.X_OK):  # a drop box: writable, not readable
                raise OutputError(self.out, f"cannot read {parent}, which a directory output "
                                  "needs (it may be written into, not listed); write the "
                                  "directory elsewhere with -o") from err  # fmt: skip
            raise OutputError(self.out, f"cannot open {parent}: {describe_os_error(err)}") from err
        except OSError as err:
            raise OutputError(self.out, f"cannot open {parent}: {describe_os_error(err)}") from err
        remove_stale_temps(parent)
        self._lock_fd = self._make_temp()
        return self.temp

    def _make_temp(self) -> int:
        """mkdir the temp directory and lock it; retried if a cleanup took it before the lock."""
        while True:
            try:
                os.mkdir(self.temp.name, 0o777, dir_fd=self._parent_fd)
                fd = os.open(
                    self.temp.name,
                    os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                    dir_fd=self._parent_fd,
                )
            except OSError as err:
                raise OutputError(
                    self.out, f"cannot create a directory in {self.out.parent}: "
                    f"{describe_os_error(err)}"
                ) from err  # fmt: skip
            td.lock_dir(fd)  # where flock fails, cleanups there use the age rule instead
            if td.same_at(fd, self._parent_fd, self.temp.name):
                return fd
            os.close(fd)
            self.temp = self.temp.with_name(
                f".{self.out.name}.qtool-tmp-{os.getpid()}-{secrets.token_hex(4)}"
            )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc is None:
                try:
                    self._publish()  # its errors name `out` (or a kept directory) themselves
                except BaseException:
                    self._discard()
                    raise
                return
            self._discard()
            if isinstance(exc, QtoolError):
                _rename_paths(exc, self.temp, self.out)
        finally:
            self._close()

    def _close(self) -> None:
        for fd in (self._lock_fd, self._parent_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._lock_fd = self._parent_fd = -1

    def _discard(self) -> None:
        """Remove the temp directory (the new build, or an old export swapped back out)."""
        if self._keep_temp:
            return
        if self._parent_fd >= 0:
            td.rmtree_at(self._parent_fd, self.temp.name)
        else:
            shutil.rmtree(self.temp, ignore_errors=True)

    # ------------------------------------------------------------ publishing

    def _publish(self) -> None:
        self._check_still_reachable()
        try:
            write_manifest(self._lock_fd)
            os.fsync(self._lock_fd)
        except OSError as err:
            raise OutputError(self.out, f"cannot write: {describe_os_error(err)}") from err
        name = self.out.name
        st = td.lstat_at(self._parent_fd, name)
        if st is not None and stat.S_ISDIR(st.st_mode) and _listdir_at(self._parent_fd, name):
            if not self.force:
                raise _appeared(self.out)
            self._replace()
        else:
            self._create(st)
        _fsync(self._parent_fd)

    def _check_still_reachable(self) -> None:
        """The build wrote its files by path: if that path no longer leads to the locked temp
        directory (its parent was moved or swapped for a link meanwhile), they went elsewhere
        and publishing would give an incomplete export."""
        try:
            st = os.stat(self.temp, follow_symlinks=False)
            same = os.path.samestat(st, os.fstat(self._lock_fd))
        except OSError:
            same = False
        if not same:
            raise OutputError(
                self.out,
                f"its directory {self.out.parent} was moved or replaced while this run wrote "
                "into it; nothing was published: run again",
            )

    def _create(self, st: os.stat_result | None) -> None:
        """`out` is missing or an empty directory: take its place, replacing nothing else."""
        name = self.out.name
        try:
            if st is None:
                renames.rename_noreplace(self._parent_fd, self.temp.name, name)
            elif stat.S_ISDIR(st.st_mode):
                os.rename(self.temp.name, name, src_dir_fd=self._parent_fd,
                          dst_dir_fd=self._parent_fd)  # fmt: skip
            else:
                raise _appeared(self.out)
        except (FileExistsError, IsADirectoryError, NotADirectoryError) as err:
            raise _appeared(self.out) from err
        except OSError as err:
            raise self._rename_error(err) from err

    def _replace(self) -> None:
        """--force over a previous export: lock it, check it, swap, check again, remove."""
        name = self.out.name
        old_fd = self._lock_out(name)
        try:
            refuse_unknown_files(self.out, old_fd, self.protected)
            try:
                swapped = renames.exchange(self._parent_fd, self.temp.name, name)
            except OSError as err:
                raise self._rename_error(err) from err
            if not swapped:
                self._move_aside_and_replace(name)
            elif td.same_at(old_fd, self._parent_fd, self.temp.name):
                self._check_swapped_out(old_fd, name)
                td.rmtree_at(self._parent_fd, self.temp.name)  # the old export, locked by us
            else:  # what we swapped out is not what we checked (renamed there meanwhile)
                self._swap_back(name, _appeared(self.out))
        finally:
            os.close(old_fd)

    def _lock_out(self, name: str) -> int:
        """A descriptor on `out`, locked, that is still `out` once locked (another --force run
        holding the lock may have replaced it meanwhile: then the new one is taken)."""
        while True:
            old_fd = td.open_dir_at(self._parent_fd, name)
            if old_fd < 0:
                raise _appeared(self.out)
            try:
                td.lock_dir(old_fd, LOCK_WAIT_S)
            except TimeoutError:
                os.close(old_fd)
                raise OutputError(
                    self.out,
                    f"is locked by another process (another qtool run replacing it?) for over "
                    f"{LOCK_WAIT_S:g} s; nothing was replaced: run again once it is done",
                ) from None
            if td.same_at(old_fd, self._parent_fd, name):
                return old_fd
            os.close(old_fd)

    def _check_swapped_out(self, old_fd: int, name: str) -> None:
        """After the swap: if anything but the old export appeared in it meanwhile, swap back."""
        try:
            refuse_unknown_files(self.out, old_fd, self.protected)
        except OutputError as err:
            self._swap_back(name, err)

    def _swap_back(self, name: str, err: OutputError) -> None:
        """Put what the swap took from `out` back and raise `err`; if that fails, move it to a
        name no cleanup takes and say where it is."""
        try:
            back = renames.exchange(self._parent_fd, self.temp.name, name)
        except OSError:
            back = False
        if back:
            raise err
        self._keep_temp = True
        kept = f"{name}.qtool-kept-{secrets.token_hex(4)}"
        try:
            renames.rename_noreplace(self._parent_fd, self.temp.name, kept)
        except OSError:
            kept = self.temp.name
        raise OutputError(
            self.out,
            f"changed while this run replaced it; its previous content is in "
            f"{self.out.parent / kept}",
        ) from None

    def _move_aside_and_replace(self, name: str) -> None:
        """No RENAME_EXCHANGE here: move the old export aside (it stays locked by us), put the
        new one in its place, and only then remove the old one."""
        aside = f".{name}.qtool-old-{os.getpid()}-{secrets.token_hex(4)}"
        fd = self._parent_fd
        try:
            os.rename(name, aside, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as err:
            raise self._rename_error(err) from err
        try:
            renames.rename_noreplace(fd, self.temp.name, name)
        except OSError as err:
            try:
                os.rename(aside, name, src_dir_fd=fd, dst_dir_fd=fd)
            except OSError:
                raise OutputError(
                    self.out,
                    f"could not take its place ({err.strerror or err}) nor put it back: "
                    f"your previous export is in {self.out.parent / aside}",
                ) from err
            if isinstance(err, FileExistsError) or err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise _appeared(self.out) from err
            raise self._rename_error(err) from err
        td.rmtree_at(fd, aside)

    def _rename_error(self, err: OSError) -> OutputError:
        """An OSError of a final rename, as an error naming `out` (never the temp name)."""
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return _appeared(self.out)
        if err.errno == errno.EBUSY:
            why = "it is busy (a mount point, or in use); nothing was replaced"
        else:
            why = describe_os_error(err)
        return OutputError(self.out, f"cannot rename into place: {why}")


# ---------------------------------------------------------------- helpers


def remove_stale_dirs(parent: Path) -> int:
    """Remove what killed runs left in `parent` (see atomic.remove_stale_temps)."""
    return remove_stale_temps(parent)


def _appeared(out: Path) -> OutputError:
    return OutputError(
        out,
        "appeared while this run was writing (another run or process); nothing was replaced "
        "and nothing of this run was left: run again, or choose another output directory",
    )


def _rename_paths(err: QtoolError, temp: Path, out: Path) -> None:
    """An error raised inside the build names `out`, as the user gave it, not the temp dir."""
    for attr in ("path", "message"):
        value = getattr(err, attr)
        if isinstance(value, str) and str(temp) in value:
            setattr(err, attr, value.replace(str(temp), str(out)))
    err.args = (err.message,)


def _listdir_at(dir_fd: int, name: str) -> list[str]:
    fd = td.open_dir_at(dir_fd, name)
    if fd < 0:
        return []
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def _fsync(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.fsync(fd)


@contextlib.contextmanager
def transaction(out: Path, *, force: bool, protected: Sequence[Path] = ()) -> Iterator[Path]:
    """`with transaction(out, ...) as temp:` (see DirTransaction)."""
    with DirTransaction(out, force=force, protected=protected) as temp:
        yield temp
