"""What a run reads and what it writes: a checkpoint as a list of shards (a single file is a
one-shard source; a sharded checkpoint is its index and shards), and the matching output set.

A sharded output keeps the sharding: each shard becomes an output shard of the same name (with
whatever files its format adds), the directory's other files (config, tokenizer) are copied
along, and a new index is written last. Every output name of a run is planned first, so
collisions and overwrites are refused before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.errors import InputError, OutputError, UsageError
from qtool.formats.qtool import sidecar_path
from qtool.io.atomic import OutputSet, describe_os_error, preflight
from qtool.io.index import (
    INDEX_SUFFIX,
    ShardedInput,
    default_output_dir,
    is_sharded,
    load_index,
)
from qtool.io.outdir import refuse_nesting
from qtool.io.safeopen import InputDir
from qtool.io.stformat import Header, read_header, read_header_file

if TYPE_CHECKING:
    from qtool.io.checkpoint import Checkpoint

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


@dataclass(frozen=True)
class Source:
    """The shards of a checkpoint, in order; `index` is None for a single file."""

    path: Path  # what the summary names: the file, or the index
    shards: tuple[Path, ...]
    index: ShardedInput | None = None
    directory: InputDir | None = None  # a model directory's single file is read through it

    @property
    def within(self) -> InputDir | None:
        """The checkpoint directory, held open, that every shard is read through (None: a
        single file, opened by the path you gave)."""
        return self.index.within if self.index is not None else self.directory

    def header(self, shard: Path) -> Header:
        """The shard's validated header (HeaderError when it is not valid safetensors)."""
        if self.within is None:
            return read_header(shard)
        with self.within.open(shard.name) as f:
            return read_header_file(f)

    def checkpoint(self, shard: Path) -> Checkpoint:
        """The shard opened for reading (through the directory, for a sharded checkpoint)."""
        from qtool.io.checkpoint import open_checkpoint  # imports torch: header-only runs don't

        return open_checkpoint(shard, self.within)

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


def open_sharded(path: Path, within: InputDir) -> Source:
    """The sharded checkpoint in the directory `within` (held open) whose index is `path`."""
    index = load_index(path, within)
    return Source(index.index, tuple(index.directory / s for s in index.shards), index)


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
    return companions_in(index.within, skip=index.index)


def companions_in(
    directory: Path | InputDir, *, skip: Path | None = None
) -> tuple[list[Path], list[str]]:
    """Files to copy along (config, tokenizer, ...): not weights, not an index, not hidden;
    only regular files inside the directory (listed and checked through its descriptor).
    Returns them and a note per file skipped."""
    within = directory if isinstance(directory, InputDir) else InputDir(directory)
    files, notes = [], []
    for name in within.names():
        p = within.file(name)
        if (
            name.startswith(".")
            or (skip is not None and name == skip.name)
            or name.endswith(WEIGHT_SUFFIXES)
            or name.endswith(INDEX_SUFFIX)
            or within.is_dir(name)
        ):
            continue
        why = within.problem(name)
        if why is None:
            files.append(p)
        else:
            notes.append(f"{p}: not copied: {why}")
    return files, notes


def companions_nbytes(within: InputDir | None, files: Sequence[Path]) -> int:
    """Bytes the companions take (for the free-space check)."""
    total = 0
    for p in files:
        st = within.lstat(p.name) if within is not None else None
        total += st.st_size if st is not None else 0
    return total


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
        copy_into(outputs, companion, target.directory / companion.name, source.index.within)
    _write_index(outputs, source.index, target.directory / source.index.index.name, total, section)


def _prepare_outdir(outdir: Path, src_dir: Path, force: bool) -> bool:
    """Check the output directory; create it if needed. True when this run created it."""
    if outdir.name in ("", ".", ".."):
        raise UsageError(
            outdir, "name the output directory itself, not '.' or '..' (e.g. ../NAME)",
            hint="output",
        )  # fmt: skip
    refuse_nesting(outdir, [src_dir])  # any spelling, link or bind mount
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


def copy_into(outputs: OutputSet, src: Path, dest: Path, within: InputDir | None = None) -> None:
    """Copy a companion through the one descriptor its directory (`within`, held open) gives:
    a regular file inside it, never a link leading out (see safeopen.InputDir)."""
    within = within or InputDir(src.parent)
    with within.open(src.name) as fin:
        fout = outputs.create(dest)
        try:
            shutil.copyfileobj(fin, fout, 1 << 20)
        except OSError as err:
            if err.errno in _WRITE_ERRORS:  # the disk filled up while copying
                raise OutputError(dest, f"cannot write: {describe_os_error(err)}") from err
            raise InputError(src, f"cannot read: {err.strerror or err}") from err


_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


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
