"""What tells a file is still the one a reader opened: `check_unchanged` compares these.

The size and mtime alone miss a rewrite in place whose writer puts the mtime back (`os.utime`,
`touch -r`, `rsync -t`, `tar x`): the values read are torn and the run would exit 0. The ctime
cannot be set by a user (any write, `utime`, `chmod` or link change moves it to the clock's
time), and the device and inode tell a file renamed over the path from the one read. Torch-free.
"""

from __future__ import annotations

import os

FileStamp = tuple[int, int, int, int, int]  # (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)


def stamp(st: os.stat_result) -> FileStamp:
    """The stamp of a stat result: device, inode, size, mtime and ctime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def fstamp(fd: int) -> FileStamp:
    """The stamp of the open file `fd` (the file read from, whatever its path names now)."""
    return stamp(os.fstat(fd))
