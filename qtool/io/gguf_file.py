"""An open GGUF file: its validated header and its tensors' bytes, read with pread.

    with GGUFFile(path) as f:
        for info in f.header.tensors:
            raw = f.tensor_bytes(info)     # read-only uint8 array of its own
            arr = f.tensor_array(info)     # typed, in torch order, or raw blocks
        f.check_unchanged()

A file that is not a valid GGUF is refused with an InputError naming it and saying what is
wrong (the parse is gguf_header's). Nothing is memory-mapped: a mapped file truncated while
open kills the process with SIGBUS, which Python cannot catch, so the header and each tensor
are read into buffers of their own and a short read is an error ("changed while reading").
The header is read in growing prefixes (256 KiB, then doubling), at most MAX_HEADER_BYTES, and
parsed once (the parse reads on where the prefix ends; the last file's header is remembered).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np

from qtool.errors import ChangedError, InputError
from qtool.io.filestamp import FileStamp, ReadLog, changed_message, stamp
from qtool.io.gguf_header import GGUFHeaderError, parse_header
from qtool.io.gguf_layout import GGUFHeader, GGUFTensorInfo
from qtool.io.safeopen import open_regular

MAX_HEADER_BYTES = 256 << 20  # a 256k-token vocabulary with its merges takes ~20 MiB
FIRST_READ = 1 << 18  # then doubling: the parse reads on, so small steps cost no reparse

# detect, inspect and the readers each open the same file: the last header parsed is kept,
# keyed by the file's device, inode, size, mtime and ctime, and taken again only when the
# header's bytes have the same digest (hashing 20 MiB takes milliseconds, parsing it seconds)
_REMEMBERED: dict[tuple[int, int, int, int, int], tuple[int, bytes, GGUFHeader]] = {}


def _blake(data: np.ndarray) -> bytes:
    return hashlib.blake2b(data.data, digest_size=32).digest()


# ggml types whose elements are plain little-endian numbers
_NUMPY = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "i1", "I16": "<i2", "I32": "<i4",
          "I64": "<i8"}  # fmt: skip


class GGUFFile:
    """A GGUF file opened read-only: `header` and a copy of any tensor's bytes on demand."""

    def __init__(self, path: str | os.PathLike[str], file: BinaryIO | None = None) -> None:
        """`file`: `path` already opened (read from instead of the path; closed with this)."""
        self.path = Path(path)
        self._file = open_regular(self.path) if file is None else file
        try:
            st = os.fstat(self._file.fileno())
            self._stat = stamp(st)
            self._log = ReadLog(self._stat)  # every span read, for check_unchanged
            if st.st_size == 0:
                raise InputError(self.path, "not a valid GGUF file: it is empty")
            self.header: GGUFHeader = self._parse(st.st_size)
        except BaseException:
            self._file.close()
            raise

    def _parse(self, size: int) -> GGUFHeader:
        st = os.fstat(self._file.fileno())
        key = (st.st_dev, st.st_ino, size, st.st_mtime_ns, st.st_ctime_ns)
        found = _REMEMBERED.get(key)
        if found is not None and found[1] == _blake(self._pread(0, found[0], "the header")):
            return found[2]
        want = min(size, FIRST_READ)
        prefix = self._pread(0, want, "the header")

        def fetch(needed: int) -> memoryview:
            nonlocal want, prefix
            if needed > MAX_HEADER_BYTES:
                raise InputError(
                    self.path, f"its GGUF header is over qtool's limit of "
                    f"{MAX_HEADER_BYTES >> 20} MiB; is it a GGUF file?",
                )  # fmt: skip
            want = min(size, max(needed, 2 * want), MAX_HEADER_BYTES)
            prefix = np.concatenate([prefix, self._pread(len(prefix), want - len(prefix),
                                                         "the header")])  # fmt: skip
            return prefix.data

        try:
            header = parse_header(prefix.data, size, fetch)
        except GGUFHeaderError as err:
            raise InputError(self.path, f"not a valid GGUF file: {err}") from None
        _REMEMBERED.clear()
        n = min(len(prefix), header.data_start)  # the header's bytes (its padding may be unread)
        _REMEMBERED[key] = (n, _blake(prefix[:n]), header)
        return header

    def _pread(self, start: int, n: int, what: str, out: np.ndarray | None = None) -> np.ndarray:
        """n bytes at `start` into `out` (a fresh uint8 array by default); a short read is an
        InputError: the file shrank while qtool was reading it."""
        buf = np.empty(n, dtype=np.uint8) if out is None else out
        view, done = buf.data, 0
        while done < n:
            got = os.preadv(self._file.fileno(), [view[done:]], start + done)
            if got == 0:
                raise ChangedError(
                    self.path,
                    f"changed while reading {what} (ended {n - done:,} bytes early); "
                    "run again once nothing is writing it",
                )
            done += got
        self._log.note(start, buf.data)
        return buf

    def tensor_bytes(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's raw data: a read-only uint8 array of `nbytes` bytes, its own memory."""
        buf = self._pread(self.header.data_start + info.offset, info.nbytes, repr(info.name))
        buf.flags.writeable = False
        return buf

    def read_into(self, info: GGUFTensorInfo, out: np.ndarray) -> None:
        """The tensor's raw data into `out`, a C-contiguous uint8 array of `nbytes` bytes."""
        if out.dtype != np.uint8 or out.size != info.nbytes or not out.flags.c_contiguous:
            raise ValueError(f"{info.name!r}: give a contiguous uint8 array of {info.nbytes}")
        self._pread(self.header.data_start + info.offset, info.nbytes, repr(info.name), out)

    def read_part(self, info: GGUFTensorInfo, skip: int, out: np.ndarray) -> None:
        """`out.size` bytes of the tensor's data from byte `skip` on (a slab of its rows) into
        `out`, a C-contiguous uint8 array; ValueError for a range beyond the tensor."""
        if (
            out.dtype != np.uint8
            or not out.flags.c_contiguous
            or not (skip >= 0 and skip + out.size <= info.nbytes)
        ):
            raise ValueError(f"{info.name!r}: bytes {skip}+{out.size} of {info.nbytes}")
        start = self.header.data_start + info.offset + skip
        self._pread(start, out.size, repr(info.name), out)

    def tensor_array(self, info: GGUFTensorInfo) -> np.ndarray:
        """Read-only, in torch order: typed for float/int types (BF16 as its uint16 bits,
        numpy has no bfloat16), else uint8 rows of blocks (..., row_bytes)."""
        raw = self.tensor_bytes(info)
        rows = info.torch_shape[:-1] if info.shape else ()
        dtype = _NUMPY.get(info.type.name)
        if dtype is not None:
            return raw.view(dtype).reshape(info.torch_shape)
        if info.type.name == "BF16":
            return raw.view("<u2").reshape(info.torch_shape)
        return raw.reshape(*rows, info.type.row_bytes(info.shape[0] if info.shape else 1))

    def fileno(self) -> int:
        """The open file's descriptor (valid until close)."""
        return self._file.fileno()

    @property
    def opened_stat(self) -> FileStamp:
        """The file's filestamp.stamp when it was opened, what check_unchanged compares."""
        return self._stat

    def check_unchanged(self) -> None:
        """Fail if the file was modified while it was being read (its data may be torn): the
        descriptor read from is checked, not whatever the path names now (filestamp.ReadLog: a
        change of its status alone passes once what was read reads the same again)."""
        if self._file.closed:
            return
        if not self._log.unchanged(self._file.fileno(), self.path):
            raise ChangedError(self.path, changed_message(self._log))

    def close(self) -> None:
        """Let go of the file (arrays already read stay valid: they own their memory)."""
        self._file.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
