"""What recording an export costs: the manifest's sampled fingerprint of a large weights file
against a full SHA-256 of it, from the page cache and cold (caches dropped, root only).

    python scripts/bench_manifest.py [SIZE_MIB] [DIR]

Writes a file of SIZE_MIB (default 4096) random-ish MiB into DIR (default a temp directory),
then times manifest.write_manifest (sampled) and a full hashlib.sha256 of the same file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qtool.io import manifest


def _drop_caches() -> bool:
    with contextlib.suppress(OSError):
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    return False


def _timed(fn: object, *args: object) -> float:
    started = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return time.perf_counter() - started


def _full_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest(directory: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (directory / manifest.MANIFEST).unlink()
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        manifest.write_manifest(fd)
    finally:
        os.close(fd)


def main() -> None:
    size_mib = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    base = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp())
    directory = base / "export"
    directory.mkdir(parents=True, exist_ok=True)
    weights = directory / "model.safetensors"
    block = os.urandom(1 << 20)
    started = time.perf_counter()
    with weights.open("wb") as f:
        for _ in range(size_mib):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - started
    print(f"file: {size_mib:,} MiB, written + fsynced in {write_s:.2f} s")
    print(f"sampled fingerprint, cached: {_timed(_manifest, directory) * 1000:.1f} ms")
    print(f"full SHA-256, cached:        {_timed(_full_sha256, weights):.2f} s")
    if _drop_caches():
        print(f"sampled fingerprint, cold:   {_timed(_manifest, directory) * 1000:.1f} ms")
        _drop_caches()
        print(f"full SHA-256, cold:          {_timed(_full_sha256, weights):.2f} s")
    weights.unlink()
    (directory / manifest.MANIFEST).unlink()


if __name__ == "__main__":
    main()
