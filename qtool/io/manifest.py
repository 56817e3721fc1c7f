"""The manifest of an export (`.qtool-export.json`): what qtool wrote into an output directory,
so that `--force` replaces a directory only when it holds nothing else, unchanged.

Each regular file is recorded by its path inside the export (`1_Pooling/config.json`; the
subdirectories qtool made are listed under `directories`), its size and a fingerprint another
writer cannot match by accident:

- files up to HASHED_MAX_BYTES (configs, tokenizers, small shards): the SHA-256 of the content;
- larger files (weights): inode, mtime_ns, and the SHA-256 of sampled blocks (the first and
  last MiB, where safetensors keeps its header and its last tensor, and SAMPLED_BLOCKS blocks
  of 64 KiB at fixed offsets between them), all read with pread. A same-size file another tool
  wrote there is a new inode (written beside and renamed) or a new mtime (written in place),
  and its sampled blocks differ; only a writer that keeps the inode, restores the mtime to the
  nanosecond and changes no sampled byte goes unnoticed. Sampling reads about 4 MiB per file
  whatever its size: a full hash would read a multi-GB export a second time, as long as the
  export itself (see docs/decisions.md for the measured cost).

Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat

from qtool.io.tempdirs import open_dir_at

MANIFEST = ".qtool-export.json"
MANIFEST_FORMAT = "qtool-export"
MANIFEST_VERSION = 2  # 1 recorded large files by size only: no longer trusted
HASHED_MAX_BYTES = 16 << 20  # files this small are hashed whole
MAX_DEPTH = 8  # subdirectory levels recorded (a copied subdirectory has at most 4)
EDGE_BYTES = 1 << 20  # the first and last MiB of a large file
SAMPLED_BLOCKS = 32
BLOCK_BYTES = 64 << 10

Record = dict[str, object]


def write_manifest(fd: int) -> None:
    """Record every regular file of the directory `fd` by its relative path
    (`1_Pooling/config.json`; see the module docstring), and its subdirectories (at most
    MAX_DEPTH levels, never through a link) under `directories`."""
    files: dict[str, Record] = {}
    directories: list[str] = []
    _record_tree(fd, "", files, directories)
    doc: dict[str, object] = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION}
    doc["files"] = files
    if directories:
        doc["directories"] = directories
    data = json.dumps(doc, indent=1).encode() + b"\n"  # ASCII: names not UTF-8 as \udcXX
    out = os.open(MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=fd)
    with os.fdopen(out, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _record_tree(fd: int, prefix: str, files: dict[str, Record], directories: list[str]) -> None:
    for name in sorted(os.listdir(fd)):
        rel = prefix + name
        if rel == MANIFEST:
            continue
        sub = open_dir_at(fd, name) if prefix.count("/") < MAX_DEPTH else -1
        if sub >= 0:
            directories.append(rel)
            try:
                _record_tree(sub, rel + "/", files, directories)
            finally:
                os.close(sub)
        elif (record := _record(fd, name)) is not None:
            files[rel] = record


def read_manifest(fd: int) -> dict[str, Record] | None:
    """The files the manifest of the directory `fd` lists (by relative path), or None when it
    has no valid one."""
    doc = _manifest_doc(fd)
    files = doc.get("files") if doc is not None else None
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        return None
    return files


def read_directories(fd: int) -> frozenset[str]:
    """The subdirectories the manifest of the directory `fd` lists (none: an older manifest,
    whose subdirectories are then not qtool's)."""
    doc = _manifest_doc(fd)
    dirs = doc.get("directories") if doc is not None else None
    if not isinstance(dirs, list):
        return frozenset()
    return frozenset(d for d in dirs if isinstance(d, str))


def _manifest_doc(fd: int) -> dict[str, object] | None:
    """The manifest of the directory `fd` as read, None when there is no valid one."""
    try:
        mfd = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        return None
    with os.fdopen(mfd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        data = f.read(HASHED_MAX_BYTES + 1)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        return None
    return doc


def unchanged(fd: int, name: str, record: Record) -> bool:
    """Whether `name` in the directory `fd` is still the file `record` describes."""
    current = _record(fd, name)
    if current is None or current["size"] != record.get("size"):
        return False
    if current["sha256"] is not None:
        return current["sha256"] == record.get("sha256")
    return all(
        record.get(k) is not None and current[k] == record.get(k)
        for k in ("inode", "mtime_ns", "sampled")
    )


def _record(fd: int, name: str) -> Record | None:
    """The record of the regular file `name` (opened without following links), or None."""
    try:
        ffd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return None
    try:
        st = os.fstat(ffd)
        if not stat.S_ISREG(st.st_mode):
            return None
        if st.st_size <= HASHED_MAX_BYTES:
            return {"size": st.st_size, "sha256": _sha256(ffd)}
        return {"size": st.st_size, "sha256": None, "inode": st.st_ino,
                "mtime_ns": st.st_mtime_ns, "sampled": sampled_digest(ffd, st.st_size)}  # fmt: skip
    except OSError:
        return None
    finally:
        os.close(ffd)


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def sample_offsets(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the blocks sampled from a file of `size` bytes, in order."""
    if size <= 2 * EDGE_BYTES + SAMPLED_BLOCKS * BLOCK_BYTES:
        return [(0, size)]
    span = size - 2 * EDGE_BYTES - BLOCK_BYTES
    blocks = [(EDGE_BYTES + span * i // (SAMPLED_BLOCKS - 1), BLOCK_BYTES)
              for i in range(SAMPLED_BLOCKS)]  # fmt: skip
    return [(0, EDGE_BYTES), *blocks, (size - EDGE_BYTES, EDGE_BYTES)]


def sampled_digest(fd: int, size: int) -> str:
    """SHA-256 of the size and the sampled blocks of the open file `fd`."""
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    for offset, length in sample_offsets(size):
        done = 0
        while done < length:
            chunk = os.pread(fd, min(length - done, 1 << 20), offset + done)
            if not chunk:
                break  # shrank meanwhile: the digest differs, as it should
            digest.update(chunk)
            done += len(chunk)
    return digest.hexdigest()
