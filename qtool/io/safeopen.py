"""Opening input files: regular files only, never blocking, reads bounded by what is read.

A FIFO, socket or device (`/dev/zero`) given as a checkpoint, shard, index or sidecar (or a
symlink to one) is refused at open time: opening is non-blocking, so a FIFO with no writer
cannot hang the run, and the type is checked on the open descriptor, so the file cannot be
swapped between the check and the read. Size limits count the bytes actually read, never
`st_size`, which a special or growing file can misstate. Torch-free.
"""

from __future__ import annotations

import errno
import os
import stat
import weakref
from pathlib import Path
from typing import BinaryIO

from qtool.errors import InputError


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open `path` for reading; InputError unless it is (a link to) a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InputError(Path(path), "no such file; check the path") from None
    except OSError as err:
        raise InputError(Path(path), f"cannot read: {err.strerror or err}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(Path(path), f"not a regular file ({file_kind(mode)}); give a file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_bounded(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The whole regular file at `path`, refused once more than `limit` bytes were read."""
    with open_regular(path) as f:
        return read_limited(f, limit, what, Path(path))


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for messages: 'a FIFO', 'a device', ..."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"


# ---------------------------------------------------------------- files inside a directory

_NOFOLLOW_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
MAX_LINK_HOPS = 8


class Refused(Exception):
    """Why a file of an input directory is not read (the message is a reason, no path)."""


class InputDir:
    """A directory opened once (O_DIRECTORY); every file qtool reads from it is opened relative
    to that descriptor, never by a path walked again.

    A file is opened with O_NOFOLLOW | O_NONBLOCK and checked on its own descriptor: a regular
    file on the directory's device, read through that one descriptor. A symlink is followed
    only when it names a file beside it (`merges.txt -> vocab.txt`), each hop opened the same
    way; any other link (`tokenizer.json -> /tmp/secret`, `-> ../x`, `-> sub/x`) is refused, so
    swapping a link between a check and a read cannot lead the read out of the directory.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise InputError(path, "no such file or directory; check the path") from None
        except NotADirectoryError:
            raise InputError(path, "not a directory") from None
        except OSError as err:
            raise InputError(path, f"cannot read: {err.strerror or err}") from None
        self._adopt(fd)

    def _adopt(self, fd: int) -> None:
        self.fd = fd
        self.device = os.fstat(fd).st_dev
        self._closer = weakref.finalize(self, os.close, fd)

    def subdir(self, name: str) -> InputDir:
        """The directory `name` inside this one, opened through this descriptor: never through a
        symlink (O_NOFOLLOW), and on the same device; Refused otherwise."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(_plain_name(name), flags, dir_fd=self.fd)
        except OSError as err:
            st = self.lstat(name)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                raise Refused(f"not a directory ({_kind(st.st_mode)})") from None
            raise Refused(f"cannot open the directory: {err.strerror or err}") from None
        sub = InputDir.__new__(InputDir)
        sub.path = self.path / name
        sub._adopt(fd)
        if sub.device != self.device:
            sub.close()
            raise Refused("on another filesystem (a mount inside the checkpoint directory)")
        return sub

    def close(self) -> None:
        self._closer()

    def file(self, name: str) -> Path:
        """The path a message names for `name`."""
        return self.path / name

    def names(self) -> list[str]:
        """The directory's entries, sorted (read through the descriptor)."""
        try:
            return sorted(os.listdir(self.fd))
        except OSError as err:
            raise InputError(self.path, f"cannot list: {err.strerror or err}") from None

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry itself (a link is not followed); None when there is none."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            return None

    def exists(self, name: str) -> bool:
        return self.lstat(name) is not None

    def is_dir(self, name: str) -> bool:
        st = self.lstat(name)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def open_fd(self, name: str) -> int:
        """A descriptor on the regular file `name` (see the class); Refused or FileNotFoundError."""
        current = _plain_name(name)
        for _ in range(MAX_LINK_HOPS):
            st = self.lstat(current)
            if st is None:
                raise FileNotFoundError(name)
            if stat.S_ISLNK(st.st_mode):
                current = self._hop(current)
                continue
            if not stat.S_ISREG(st.st_mode):  # never open a device or FIFO, even non-blocking
                raise Refused(f"not a regular file ({file_kind(st.st_mode)})")
            try:
                fd = os.open(current, _NOFOLLOW_OPEN, dir_fd=self.fd)
            except OSError as err:
                if err.errno == errno.ELOOP:  # became a link since the lstat: look again
                    continue
                if isinstance(err, FileNotFoundError):
                    raise
                raise Refused(f"cannot read: {err.strerror or err}") from None
            return self._checked(fd)
        raise Refused(f"a chain of more than {MAX_LINK_HOPS} symlinks")

    def _hop(self, name: str) -> str:
        try:
            target = os.readlink(name, dir_fd=self.fd)
        except OSError as err:
            raise Refused(f"cannot read the symlink: {err.strerror or err}") from None
        while target.startswith("./"):
            target = target[2:]
        if "/" in target or target in ("", ".", ".."):
            raise Refused(
                f"a symlink to {target}, which may lead outside the checkpoint directory "
                "(qtool follows only links to a file beside them)"
            )
        return target

    def _checked(self, fd: int) -> int:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Refused(f"not a regular file ({file_kind(st.st_mode)})")
            if st.st_dev != self.device:
                raise Refused("on another filesystem (a mount inside the checkpoint directory)")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open(self, name: str) -> BinaryIO:
        """The regular file `name` opened for reading (InputError naming it otherwise)."""
        try:
            return os.fdopen(self.open_fd(name), "rb")
        except FileNotFoundError:
            raise InputError(self.file(name), "no such file; check the path") from None
        except Refused as why:
            raise InputError(
                self.file(name),
                f"{why}; qtool reads only regular files inside the checkpoint directory "
                "(copy the file in, e.g. cp -L, instead of linking it)",
            ) from None

    def problem(self, name: str) -> str | None:
        """Why `name` cannot be read (a reason for a note), or None when it can."""
        try:
            os.close(self.open_fd(name))
        except FileNotFoundError:
            return "no such file"
        except Refused as why:
            return str(why)
        return None

    def read(self, name: str, limit: int, what: str) -> bytes:
        """The whole file `name`, refused once more than `limit` bytes were read."""
        with self.open(name) as f:
            return read_limited(f, limit, what, self.file(name))


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    return "a file" if stat.S_ISREG(mode) else file_kind(mode)


def _plain_name(name: str) -> str:
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise Refused(f"{name!r} is not a plain file name inside the directory")
    return name


def read_limited(f: BinaryIO, limit: int, what: str, path: Path) -> bytes:
    """All of `f` (from its start), refused once more than `limit` bytes were read."""
    f.seek(0)
    data = f.read(limit + 1)
    if len(data) > limit:
        raise InputError(path, f"{what} is over {limit:,} bytes; refusing to parse it")
    return data
