"""llama-imatrix's legacy .dat format, read as llama-imatrix --in-file reads it.

Little-endian: n_entries i32, then per entry: name length i32, the name, ncall i32 (chunks),
nval i32, nval f32 (each = sum x_j^2 / count * ncall); then, optionally, the chunk count i32
and the dataset name (length i32, bytes). The file holds neither the chunk size nor the number
of matrices: like llama.cpp, qtool takes sums = value * chunk_size and one count of ncall *
chunk_size rows per weight (n_mat = 1, K = nval; MatrixStats.merged spreads it over a GGUF
file's matrices), and chunk_count = the largest ncall.

Read with pread, each field checked against the bytes left before anything is allocated, so a
hostile or mistaken file (a model given as the imatrix) costs no more memory than it holds.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from qtool.errors import ChangedError, InputError
from qtool.io.filestamp import CHANGED, stamp
from qtool.io.gguf_header import MAX_NAME_BYTES
from qtool.io.safeopen import open_regular
from qtool.numerics.imatrix import MAX_CHUNK_SIZE, ImportanceMatrix, MatrixStats

DAT_CHUNK_SIZE = 512  # llama-imatrix's default context (n_ctx / n_parallel): tokens per chunk
MAX_DATASET_BYTES = 1 << 16
_MIN_ENTRY = 4 + 1 + 4 + 4 + 4  # name length, a 1-byte name, ncall, nval, one value
REDO = "re-create it with llama-imatrix or qtool calibrate"
_F32_MAX = float(np.finfo(np.float32).max)


class _Cursor:
    """Reads the file at `path` (descriptor `fd`, `size` bytes) front to back with pread."""

    def __init__(self, fd: int, size: int, path: Path) -> None:
        self.fd, self.size, self.pos, self.path = fd, size, 0, path

    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise InputError(self.path, f"truncated: {what} at byte {self.pos} needs {n} "
                             f"bytes, {self.left()} are left")  # fmt: skip
        data = os.pread(self.fd, n, self.pos)
        while len(data) < n:
            more = os.pread(self.fd, n - len(data), self.pos + len(data))
            if not more:
                raise ChangedError(self.path, f"changed while reading {what}; run again once "
                                 "nothing is writing it")  # fmt: skip
            data += more
        self.pos += n
        return data

    def i32(self, what: str) -> int:
        value: int = struct.unpack("<i", self.take(4, what))[0]
        return value


def read_dat(
    path: Path, chunk_size: int = DAT_CHUNK_SIZE, file: BinaryIO | None = None
) -> ImportanceMatrix:
    """The statistics of a legacy .dat file, as llama-imatrix holds them after --in-file with
    a context of `chunk_size` tokens; InputError naming the file (and entry) if it is bad.
    `file`: `path` already opened (read from instead of the path; closed here)."""
    with open_regular(path) if file is None else file as f:
        if not 1 <= chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk size {chunk_size} is not in 1..{MAX_CHUNK_SIZE}")
        st = os.fstat(f.fileno())
        size = st.st_size
        cur = _Cursor(f.fileno(), size, path)
        n = cur.i32("the entry count")
        if n < 1:
            raise InputError(path, f"declares {n} entries; is it an importance matrix?")
        if n * _MIN_ENTRY > cur.left():
            raise InputError(path, f"declares {n} entries, which a {size}-byte file cannot "
                             "hold; is it an importance matrix?")  # fmt: skip
        raw = [_entry(cur, i) for i in range(n)]
        datasets = _trailer(cur)
        now = os.fstat(f.fileno())
        if stamp(now) != stamp(st):  # ctime too: a writer can put the mtime back
            raise ChangedError(path, CHANGED)
    entries: dict[str, MatrixStats] = {}
    for name, ncall, values in raw:
        if name in entries:
            raise InputError(path, f"appears twice; {REDO}", name)
        entries[name] = _stats(path, name, ncall, values, chunk_size)
    chunk_count = max(ncall for _, ncall, _ in raw)
    try:
        return ImportanceMatrix(entries, chunk_size, chunk_count, datasets)
    except ValueError as err:
        raise InputError(path, f"not a usable importance matrix: {err}") from None


def _entry(cur: _Cursor, i: int) -> tuple[str, int, np.ndarray]:
    length = cur.i32(f"the name length of entry {i}")
    if not 1 <= length <= MAX_NAME_BYTES:
        raise InputError(cur.path, f"entry {i} has a name of {length} bytes; ggml's names "
                         f"are 1 to {MAX_NAME_BYTES}; is it an importance matrix?")  # fmt: skip
    name = _text(cur, cur.take(length, f"the name of entry {i}"), f"the name of entry {i}")
    ncall, nval = cur.i32(f"the chunk count of {name!r}"), cur.i32(f"the size of {name!r}")
    if ncall < 0:
        raise InputError(cur.path, f"a chunk count of {ncall}, never negative; {REDO}", name)
    if nval < 1:
        raise InputError(cur.path, f"declares {nval} values; an entry holds at least one", name)
    if 4 * nval > cur.left():
        raise InputError(cur.path, f"declares {nval} values, more than the file holds", name)
    values = np.frombuffer(cur.take(4 * nval, f"the values of {name!r}"), dtype="<f4")
    return name, ncall, values


def _trailer(cur: _Cursor) -> tuple[str, ...]:
    """The dataset name after the entries (none in old files); nothing may follow it."""
    if cur.left() == 0:
        return ()
    cur.i32("the chunk count at the end")  # llama.cpp ignores it too: ncall says it per entry
    if cur.left() == 0:
        return ()
    length = cur.i32("the dataset name's length")
    if not 0 <= length <= min(cur.left(), MAX_DATASET_BYTES):
        raise InputError(cur.path, f"a dataset name of {length} bytes, with {cur.left()} left; "
                         f"is it an importance matrix? {REDO}")  # fmt: skip
    name = _text(cur, cur.take(length, "the dataset name"), "the dataset name")
    if cur.left():
        raise InputError(cur.path, f"{cur.left()} bytes after the dataset name; is it an "
                         "importance matrix?")  # fmt: skip
    return (name,)


def _text(cur: _Cursor, raw: bytes, what: str) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(cur.path, f"{what} is not UTF-8; is it an importance matrix?") from None
    if "\0" in text:
        raise InputError(cur.path, f"{what} holds a NUL byte")
    return text


def _stats(path: Path, name: str, ncall: int, values: np.ndarray, chunk_size: int) -> MatrixStats:
    if not (np.isfinite(values) & (values >= 0)).all():
        raise InputError(path, "holds negative, NaN or infinite values (means of squares are "
                         "never any of these)", name)  # fmt: skip
    wide = values.astype(np.float64) * chunk_size  # llama.cpp: tmp[i] * chunk_size
    if wide.max(initial=0.0) > _F32_MAX:  # the value is finite; its sum is not, in float32
        raise InputError(path, f"holds a mean square of {float(values.max()):.3g}: over "
                         f"{chunk_size}-token chunks its sum exceeds float32, which an imatrix "
                         f"holds; {REDO}", name)  # fmt: skip
    sums = wide.astype(np.float32)
    counts = np.array([ncall * chunk_size], dtype=np.int64)
    try:
        return MatrixStats(sums.reshape(1, -1), counts)
    except ValueError as err:
        raise InputError(path, f"not usable statistics: {err}", name) from None
