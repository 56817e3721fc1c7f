"""What tells a file is still the one a reader opened: `check_unchanged` compares these.

The size and mtime alone miss a rewrite in place whose writer puts the mtime back (`os.utime`,
`touch -r`, `rsync -t`, `tar x`): the values read are torn and the run would exit 0. The ctime
cannot be set by a user (any write, `utime`, `chmod` or link change moves it to the clock's
time), and the device and inode tell a file renamed over the path from the one read. Torch-free.

The ctime alone moving is ambiguous: a status change (chmod, chown, xattrs, a hard link, atime
put back by a backup tool) or a rewrite whose writer put the mtime back. A `ReadLog` tells
them apart without stopping the run: it keeps a CRC-32 of every span its reader read, and a
change of the ctime alone is accepted only once every span reads the same again (the data used
is then the file's as it is now) and the path still names the file.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

FileStamp = tuple[int, int, int, int, int]  # (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)


def stamp(st: os.stat_result) -> FileStamp:
    """The stamp of a stat result: device, inode, size, mtime and ctime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def fstamp(fd: int) -> FileStamp:
    """The stamp of the open file `fd` (the file read from, whatever its path names now)."""
    return stamp(os.fstat(fd))


# A ctime-only change costs one re-read of every span read so far; more changes than this in
# one run are refused (at most this many extra passes over the file, whatever touches it).
MAX_RECHECKS = 4
CHANGED = "the file changed while qtool was reading it; run again"
KEPT_CHANGING = (
    f"its status (permissions, owner, links or times) changed more than {MAX_RECHECKS} times "
    "while qtool read it; run again once nothing is changing it"
)


def changed_message(log: ReadLog) -> str:
    """The one line for a file `log` found changed: a rewrite, or a status that kept changing."""
    if log.kept_changing:
        return KEPT_CHANGING
    return CHANGED


RECHECK_BLOCK = 1 << 20  # bytes re-read at a time


class ReadLog:
    """What one reader read from one open file: each span's CRC-32 and the stamp it holds to.
    `unchanged` says whether the data read is still the file's (see the module's docstring)."""

    def __init__(self, opened: FileStamp) -> None:
        self.stamp = opened
        self.rechecks = 0  # ctime-only changes checked by re-reading
        self.reread = 0  # bytes re-read by them
        self._spans: dict[tuple[int, int], int] = {}
        self._differs = False
        self.kept_changing = False  # refused for its status changing past MAX_RECHECKS alone

    def note(self, offset: int, data: bytes | memoryview) -> None:
        """`data` was read at `offset` (before it is used: its CRC is of what the reader got)."""
        crc = zlib.crc32(data)
        if self._spans.setdefault((offset, len(data)), crc) != crc:
            self._differs = True  # the same bytes read twice differ: rewritten in between

    def unchanged(self, fd: int, path: Path) -> bool:
        """Whether the file open as `fd` still holds every byte read, through a status-only
        change too: the device, inode, size and mtime as at open, the path naming the file (and
        the file still having a name: a path through /proc/self/fd names it deleted), and
        each span's CRC the same when re-read (with no change while re-read). A file whose
        ctime moved again after MAX_RECHECKS such checks counts as changed."""
        st = os.fstat(fd)
        now = stamp(st)
        if now == self.stamp or self._differs:
            return not self._differs
        if now[:4] != self.stamp[:4] or st.st_nlink == 0:
            return False  # no link left: deleted or renamed over, even read through /proc
        if self.rechecks >= MAX_RECHECKS:
            self.kept_changing = True
            return False
        try:
            named = os.stat(path)
        except OSError:
            return False  # deleted or renamed away: the path no longer names what was read
        if (named.st_dev, named.st_ino) != now[:2]:
            return False
        self.rechecks += 1
        if not self._spans_read_the_same(fd) or fstamp(fd) != now:
            return False
        self.stamp = now
        return True

    def _spans_read_the_same(self, fd: int) -> bool:
        block = bytearray(RECHECK_BLOCK)
        view = memoryview(block)
        for (offset, size), crc in self._spans.items():
            got, done = 0, 0
            while done < size:
                n = os.preadv(fd, [view[: min(RECHECK_BLOCK, size - done)]], offset + done)
                if n == 0:
                    return False
                got = zlib.crc32(view[:n], got)
                done += n
            self.reread += size
            if got != crc:
                return False
        return True
