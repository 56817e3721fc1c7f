"""llama.cpp's importance-matrix files (llama-imatrix's output), both ways.

    imatrix = read_imatrix(path)            # GGUF or legacy .dat, told apart by content
    write_imatrix(path, imatrix)            # GGUF, byte for byte as llama-imatrix writes it
    hf = imatrix.renamed(hf_names_of(imatrix, "llama", 30, checkpoint_names))

The statistics are numerics.imatrix values (merge there). Names are llama.cpp's
(`blk.0.attn_q.weight`); hf_names_of maps them to a Hugging Face checkpoint's with the name
map `compare` uses (formats/gguf/names.py). An imatrix is per input column, so the rotary
row permutation llama.cpp's converter applies to attn_q/attn_k does not touch it. Not a
checkpoint format: nothing registers it, commands name it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from qtool.errors import ChangedError, InputError
from qtool.formats.imatrix.dat import DAT_CHUNK_SIZE, read_dat
from qtool.formats.imatrix.ggufimatrix import read_gguf_from, write_gguf_imatrix
from qtool.io.filestamp import CHANGED, stamp
from qtool.io.gguf_layout import GGUFValue
from qtool.io.safeopen import open_regular
from qtool.numerics.imatrix import ImportanceMatrix

__all__ = [
    "DAT_CHUNK_SIZE", "ImatrixFile", "hf_names_of", "read_imatrix", "read_imatrix_file",
    "write_imatrix",
]  # fmt: skip
HASH_BLOCK = 1 << 20  # bytes read at a time for the file's SHA-256


@dataclass(frozen=True)
class ImatrixFile:
    """An imatrix file as one descriptor read it: the statistics, the GGUF metadata (empty for
    a .dat) and the SHA-256 of the bytes parsed."""

    imatrix: ImportanceMatrix
    metadata: Mapping[str, GGUFValue]
    sha256: str


def read_imatrix(path: Path, dat_chunk_size: int = DAT_CHUNK_SIZE) -> ImportanceMatrix:
    """The statistics in `path`: a GGUF imatrix if it starts with b'GGUF', else a legacy .dat
    (whose chunk size the file does not hold: `dat_chunk_size`, llama-imatrix's default)."""
    return read_imatrix_file(path, dat_chunk_size, digest=False).imatrix


def read_imatrix_file(
    path: Path, dat_chunk_size: int = DAT_CHUNK_SIZE, *, digest: bool = True
) -> ImatrixFile:
    """read_imatrix through one open descriptor, with the file's metadata and (`digest`) the
    SHA-256 of the same bytes, hashed after the parse (a file that is no imatrix is refused
    before it is hashed whole) and refused if the file changed in between. A change of its
    status alone (chmod, a hard link, the atime put back: the ctime moved, nothing else) has
    it read once more, whole, and that read is used only if nothing changed during it (if it
    fails, the change is what is reported: the file may have been rewritten under the first)."""
    opened: list[os.stat_result] = []
    try:
        return _read_imatrix_once(path, dat_chunk_size, digest, opened)
    except ChangedError as err:
        if not (opened and _status_moved(path, opened[0])):
            raise
        first = err
    try:
        return _read_imatrix_once(path, dat_chunk_size, digest, [])
    except InputError:
        raise first from None


def _status_moved(path: Path, opened: os.stat_result) -> bool:
    """Whether `path` is the file stamped `opened`, of its size and mtime, its ctime moved."""
    try:
        now = stamp(os.stat(path))
    except OSError:
        return False
    return now[:4] == stamp(opened)[:4] and now != stamp(opened)


def _read_imatrix_once(
    path: Path, dat_chunk_size: int, digest: bool, opened: list[os.stat_result]
) -> ImatrixFile:
    """read_imatrix_file's one read (the file's stat at open appended to `opened`)."""
    with open_regular(path) as f:
        fd = f.fileno()
        st = os.fstat(fd)
        opened.append(st)
        magic = os.pread(fd, 4, 0)
        if not magic:
            raise InputError(path, "is empty; give an importance matrix written by llama-imatrix")
        twin = os.fdopen(os.dup(fd), "rb")  # the parser closes its own; the same open file
        if magic == b"GGUF":
            imatrix, meta = read_gguf_from(path, twin)
        else:
            imatrix, meta = read_dat(path, dat_chunk_size, twin), {}
        sha = _sha256(fd, st.st_size) if digest else ""
        now = os.fstat(fd)
        if stamp(now) != stamp(st):  # ctime too: a writer can put the mtime back
            raise ChangedError(path, CHANGED)
    return ImatrixFile(imatrix, meta, sha)


def _sha256(fd: int, size: int) -> str:
    digest = hashlib.sha256()
    pos = 0
    while pos < size and (block := os.pread(fd, min(HASH_BLOCK, size - pos), pos)):
        digest.update(block)
        pos += len(block)
    return digest.hexdigest()


def write_imatrix(
    path: Path, imatrix: ImportanceMatrix, extra: Mapping[str, GGUFValue] | None = None
) -> None:
    """`imatrix` as a GGUF imatrix file at `path`, written atomically (with `extra` metadata
    keys after llama-imatrix's own)."""
    write_gguf_imatrix(path, imatrix, extra)


def hf_names_of(
    imatrix: ImportanceMatrix, arch: str, n_blocks: int, hf_names: Sequence[str]
) -> dict[str, str]:
    """For each entry of `imatrix` some name of `hf_names` maps to (gguf-py's name map for
    architecture `arch` with `n_blocks` blocks, as compare pairs a GGUF with its checkpoint),
    llama.cpp's name -> the Hugging Face name. Entries nothing maps to are left out.
    ValueError for more blocks than llama.cpp loads (the map's cost grows with the number)."""
    from qtool.formats.gguf.names import MAX_BLOCKS, gguf_names

    if not 0 <= n_blocks <= MAX_BLOCKS:
        raise ValueError(f"{n_blocks} blocks: llama.cpp loads models of 0 to {MAX_BLOCKS}")
    found = {g: hf for hf, g in gguf_names(arch, n_blocks, hf_names).items()}
    return {name: found[name] for name in imatrix.entries if name in found}
