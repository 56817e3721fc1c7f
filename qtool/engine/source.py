"""What a run reads and what it writes: a checkpoint as a list of shards (a single file is a
one-shard source; a sharded checkpoint is its index and shards), and the matching output set.

A sharded output keeps the sharding: each shard becomes an output shard of the same name (with
whatever files its format adds), the directory's other files (config, tokenizer) are copied
along, and a new index is written last. Every output name of a run is planned first, so
collisions and overwrites are refused before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from qtool.errors import InputError, OutputError
from qtool.formats.qtool import sidecar_path
from qtool.io.atomic import OutputSet, preflight
from qtool.io.index import (
    INDEX_SUFFIX,
    ShardedInput,
    companion_problem,
    default_output_dir,
    is_sharded,
    load_index,
)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


@dataclass(frozen=True)
class Source:
    """The shards of a checkpoint, in order; `index` is None for a single file."""

    path: Path  # what the summary names: the file, or the index
    shards: tuple[Path, ...]
    index: ShardedInput | None = None

    @property
    def protected(self) -> list[Path]:
        """No output may replace these: the inputs, the sidecars beside them, and for a sharded
        checkpoint everything in its directory."""
        files = [self.path, *self.shards]
        if self.index is not None:
            files += list(self.index.directory.iterdir())
        return protected_paths(files)


def protected_paths(inputs: Iterable[Path]) -> list[Path]:
    """The inputs and the qparams sidecar beside each: no output may replace any of them."""
    return [q for p in inputs for q in (p, sidecar_path(p))]


def check_output(out: Path, inputs: list[Path], force: bool, needed_bytes: int = 0) -> None:
    """Before any data is read: refuse an output that would overwrite an input (or its
    sidecar), an existing file (without --force) or anything but a regular file, or that cannot
    be written (missing, read-only, full directory). One output; see atomic.preflight."""
    preflight([out], protected_paths(inputs), force=force, needed_bytes=needed_bytes)


def open_source(path: Path) -> Source:
    """A single checkpoint file, or a sharded checkpoint (its index, or its directory)."""
    if not is_sharded(path):
        return Source(path, (path,))
    index = load_index(path)
    shards = tuple(index.directory / shard for shard in index.shards)
    return Source(index.index, shards, index)


@dataclass(frozen=True)
class Target:
    """Where a run writes: one output per shard; for a sharded source, a directory."""

    shard_outputs: tuple[Path, ...]  # in the order of Source.shards
    directory: Path | None = None

    @property
    def named(self) -> list[Path]:
        """What the summary names as written."""
        return [self.directory] if self.directory is not None else list(self.shard_outputs)


def target_for(source: Source, out: Path | None, default_file: Path, dir_suffix: str) -> Target:
    """Output paths: `out` (or `default_file`) for a file; `out` (or `<dir>.<suffix>` beside
    the input directory) holding shards of the same names for a sharded checkpoint."""
    if source.index is None:
        return Target((out or default_file,))
    directory = out or default_output_dir(source.index.index, dir_suffix)
    return Target(tuple(directory / shard.name for shard in source.shards), directory)


def companion_files(index: ShardedInput) -> tuple[list[Path], list[str]]:
    """A sharded checkpoint's companions (see companions_in), its index file excluded."""
    return companions_in(index.directory, skip=index.index)


def companions_in(directory: Path, *, skip: Path | None = None) -> tuple[list[Path], list[str]]:
    """Files to copy along (config, tokenizer, ...): not weights, not an index, not hidden;
    only regular files inside the directory. Returns them and a note per file skipped."""
    files, notes = [], []
    for p in sorted(directory.iterdir()):
        if (
            p.name.startswith(".")
            or p == skip
            or p.name.endswith(WEIGHT_SUFFIXES)
            or p.name.endswith(INDEX_SUFFIX)
            or (p.is_dir() and not p.is_symlink())
        ):
            continue
        why = companion_problem(directory, p)
        if why is None:
            files.append(p)
        else:
            notes.append(f"{p}: not copied: {why}")
    return files, notes


@contextmanager
def prepared(
    source: Source,
    target: Target,
    layout: Callable[[Path], list[Path]],
    force: bool,
    also: Sequence[Path] = (),
    needed_bytes: int = 0,
    *,
    protect: Sequence[Path] = (),
) -> Iterator[list[str]]:
    """Check every output of the run before anything is written (creating the output directory
    of a sharded run); `protect`: more files no output may replace. Yields the notes about
    companions not copied. If the body fails, a directory this run created is removed again
    when it is empty."""
    files = [f for out in target.shard_outputs for f in layout(out)]
    notes: list[str] = []
    created = False
    if target.directory is not None and source.index is not None:
        companions, notes = companion_files(source.index)
        files += [target.directory / c.name for c in companions]
        files.append(target.directory / source.index.index.name)
        created = _prepare_outdir(target.directory, source.index.directory, force)
    try:
        protected = [*source.protected, *protect]
        preflight([*files, *also], protected, force=force, needed_bytes=needed_bytes)
        yield notes
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(target.directory)  # type: ignore[arg-type]
        raise


def finish_directory(
    outputs: OutputSet, source: Source, target: Target, total: int, section: dict[str, object]
) -> None:
    """Copy the companions and write the index (last) of a sharded output."""
    if source.index is None or target.directory is None:
        return
    for companion in companion_files(source.index)[0]:
        copy_into(outputs, companion, target.directory / companion.name)
    _write_index(outputs, source.index, target.directory / source.index.index.name, total, section)


def _prepare_outdir(outdir: Path, src_dir: Path, force: bool) -> bool:
    """Check the output directory; create it if needed. True when this run created it."""
    if outdir.exists() and os.path.samefile(outdir, src_dir):  # any spelling, link or mount
        raise OutputError(outdir, "is the input directory; choose another -o")
    if outdir.exists() and not outdir.is_dir():
        raise OutputError(outdir, "exists and is not a directory")
    if outdir.is_dir() and any(not p.name.startswith(".") for p in outdir.iterdir()) and not force:
        raise OutputError(
            outdir,
            "already exists and is not empty; its files are replaced only when asked",
            hint="force",
        )
    if not outdir.parent.is_dir():
        raise OutputError(outdir, f"directory {outdir.parent} does not exist; create it first")
    created = not outdir.exists()
    outdir.mkdir(exist_ok=True)
    return created


def copy_into(outputs: OutputSet, src: Path, dest: Path) -> None:
    """Copy a companion: the resolved file, opened without following links, if regular."""
    try:
        fd = os.open(os.path.realpath(src), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        raise InputError(src, f"cannot read: {err.strerror}") from None
    with os.fdopen(fd, "rb") as fin:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError(src, "changed while reading: no longer a regular file")
        shutil.copyfileobj(fin, outputs.create(dest), 1 << 20)


def _write_index(
    outputs: OutputSet, index: ShardedInput, dest: Path, total: int, section: dict[str, object]
) -> None:
    doc = {k: v for k, v in index.raw.items() if k not in ("metadata", "weight_map", "qtool")}
    doc["metadata"] = {**index.metadata, "total_size": total}
    if section:
        doc["qtool"] = section
    doc["weight_map"] = dict(sorted(index.weight_map.items()))
    data = json.dumps(doc, indent=2, ensure_ascii=False).encode() + b"\n"
    outputs.create(dest, last=True).write(data)
