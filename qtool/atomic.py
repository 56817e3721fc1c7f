"""Output files that appear under their final names complete, or not at all.

Each output is written to `.<name>.qtool-tmp-<pid>-<random>` in its target directory (O_EXCL,
mode 0o666 & ~umask), flushed and fsynced, then renamed into place in the order the files were
added (so the file that binds the set, a sidecar or index, is added last and lands last), and the
directories are fsynced. On any exception every temp file is removed and no final name is
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
        self._files: list[tuple[Path, Path, BinaryIO]] = []  # (temp, final, handle)
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

    def create(self, final: Path) -> BinaryIO:
        """Open a new temp file that will become `final` on commit."""
        temp = final.parent / f".{final.name}.qtool-tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as err:
            raise OutputError(
                final, f"cannot create a file in {final.parent}: {_why(err)}"
            ) from err
        handle = os.fdopen(fd, "wb")
        self._files.append((temp, final, handle))
        return handle

    def commit(self) -> None:
        """fsync every file, rename each into place in order, fsync the directories."""
        for _temp, final, handle in self._files:
            try:
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()
            except OSError as err:
                raise OutputError(final, f"cannot write: {_why(err)}") from err
        for temp, final, _ in self._files:
            os.replace(temp, final)
        self._committed = True
        for directory in {final.parent for _, final, _ in self._files}:
            _fsync_dir(directory)

    def abort(self) -> None:
        for temp, _, handle in self._files:
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


def _why(err: OSError) -> str:
    if err.errno == errno.ENOSPC:
        return "no space left on device; free some space or write elsewhere with -o"
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission denied; choose a writable location with -o"
    return err.strerror or str(err)
