"""Opening input files: regular files only, never blocking, reads bounded by what is read.

A FIFO, socket or device (`/dev/zero`) given as a checkpoint, shard, index or sidecar (or a
symlink to one) is refused at open time: opening is non-blocking, so a FIFO with no writer
cannot hang the run, and the type is checked on the open descriptor, so the file cannot be
swapped between the check and the read. Size limits count the bytes actually read, never
`st_size`, which a special or growing file can misstate. Torch-free.
"""

from __future__ import annotations

import os
import stat
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
        data = f.read(limit + 1)
    if len(data) > limit:
        raise InputError(Path(path), f"{what} is over {limit:,} bytes; refusing to parse it")
    return data


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
