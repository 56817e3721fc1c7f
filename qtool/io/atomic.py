"""Output files that appear under their final names complete, or not at all.

Each output is written to `.<name>.qtool-tmp-<pid>-<random>` in its target directory (O_EXCL,
mode 0o666 & ~umask), flushed and fsynced, then renamed into place, and the directories are
fsynced. Files created with `last=True` (the file a user opens: the quantized file, an index)
are renamed after all the others, so whenever one exists under its final name, everything it
refers to is already in place. On any exception every temp file is removed and no final name is
touched. A SIGKILL can leave temp files; they never look like output, and the next run in that
directory removes those whose process is gone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from qtool.errors import OutputError

_TEMP_RE = re.compile(r"^\..+\.qtool-tmp-(\d+)-[0-9a-f]+$")


class OutputSet:
    """Context manager collecting temp files; `commit()` renames them, leaving aborts clean."""

    def __init__(self) -> None:
        self._files: list[tuple[Path, Path, BinaryIO, bool]] = []  # (temp, final, handle, last)
        self._committed = False

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
        """Open a new temp file that will become `final` on commit (after the others if last)."""
        temp = final.parent / f".{final.name}.qtool-tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as err:
            raise OutputError(
                final, f"cannot create a file in {final.parent}: {describe_os_error(err)}"
            ) from err
        handle = os.fdopen(fd, "wb")
        self._files.append((temp, final, handle, last))
        return handle

    def commit(self) -> None:
        """fsync every file, rename each into place in order, fsync the directories."""
        for _temp, final, handle, _last in self._files:
            try:
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()
            except OSError as err:
                raise OutputError(final, f"cannot write: {describe_os_error(err)}") from err
        ordered = sorted(self._files, key=lambda f: f[3])  # stable: creation order, last ones last
        for temp, final, _, _ in ordered:
            try:
                os.replace(temp, final)
            except OSError as err:
                raise OutputError(
                    final, f"cannot rename into place: {describe_os_error(err)}"
                ) from err
        self._committed = True
        for directory in {final.parent for _, final, _, _ in self._files}:
            _fsync_dir(directory)

    def abort(self) -> None:
        for temp, _, handle, _ in self._files:
            with contextlib.suppress(OSError):
                handle.close()
            with contextlib.suppress(OSError):
                temp.unlink()
        self._files.clear()


def remove_stale_temps(directory: Path) -> int:
    """Delete temp files left in `directory` by qtool runs that were killed; return the count."""
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            match = _TEMP_RE.match(entry.name)
            if match and not _pid_alive(int(match.group(1))):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed += 1
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
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
