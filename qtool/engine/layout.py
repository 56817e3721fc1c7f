"""Where a run writes, for quantize and dequantize alike: one output file per input shard, or a
directory (a checkpoint directory in, a directory out; every format's model directory).

A file output is checked before any data is read (atomic.preflight: never an input or its
sidecar, not an existing file without --force) and written by an OutputSet (temporary names,
renamed when all is written). A directory output is built by an outdir.DirTransaction: under
a locked temporary name beside its final one, published without replacing anything but a
previous qtool export (with --force), so it appears whole or not at all and never costs the
user a file qtool did not write. It holds one shard per input shard under the same name (a
lone file becomes `model.safetensors`), the format's own files (config.json), every other file
of the input directory, and a rewritten index (last) when the input had one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from qtool.engine.companions import Companions, companions, copy_companions
from qtool.engine.source import Source, protected_paths
from qtool.errors import OutputError, UsageError
from qtool.io.atomic import (
    OutputSet,
    file_id,
    preflight,
    remove_stale_temps,
)
from qtool.io.index import ShardedInput
from qtool.io.outdir import DirTransaction, check_out_dir, refuse_nesting

SINGLE_SHARD_NAME = "model.safetensors"
_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".gguf")


@dataclass(frozen=True)
class Target:
    """Where a run writes: one output per input shard, in the order of Source.shards; for a
    directory output, inside `directory`."""

    shard_outputs: tuple[Path, ...]
    directory: Path | None = None

    @property
    def named(self) -> list[Path]:
        """What the summary names as written."""
        return [self.directory] if self.directory is not None else list(self.shard_outputs)


def check_files(outputs: Sequence[Path], inputs: Sequence[Path], force: bool) -> None:
    """Before any data is read: refuse output files that would replace an input (or what belongs
    to it: its sidecar), an existing file without `force`, or anything but a regular file."""
    preflight(outputs, protected_paths(inputs), force=force)


def file_target(out: Path) -> Target:
    return Target((out,))


def directory_target(source: Source, directory: Path) -> Target:
    """The input's shards under their own names in `directory` (a lone file: model.safetensors)."""
    names = [s.name for s in source.shards] if source.directory else [SINGLE_SHARD_NAME]
    return Target(tuple(directory / n for n in names), directory)


def default_directory(source: Source, suffix: str) -> Path:
    """`models/llama/` -> `models/llama.<suffix>/` beside it."""
    assert source.directory is not None
    directory = source.directory.resolve()
    return directory.with_name(f"{directory.name}.{suffix}")


def refuse_file_name(out: Path | None, what: str) -> None:
    """A directory's output is a directory: a weight-file name for it is a mistake."""
    if out is not None and out.suffix.lower() in _FILE_SUFFIXES and not out.is_dir():
        raise UsageError(
            out,
            f"{what} of a checkpoint directory writes a directory; "
            f"give -o a directory name (e.g. {out.with_name(out.stem)})",
        )


@dataclass(frozen=True)
class Placement:
    """A prepared output: `target` is where the run writes now (for a directory, inside its
    temporary directory), `scratch` where temporary files may go; for a directory, the
    companions to copy along (companions.py) and notes about those not copied; the stale
    temporary files of killed runs removed."""

    target: Target
    scratch: Path
    notes: list[str] = field(default_factory=list)
    stale: int = 0
    companions: Companions = Companions()


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
) -> Iterator[Placement]:
    """Check every output of the run before anything is written (`layout`: the files one
    output shard occupies; `also`: files the caller writes afterwards; `protect`: more files no
    output may replace), then give where to write; a directory is published when the body
    succeeds and removed when it fails."""
    protected, files, found = _checked(source, target, layout, force, also, needed_bytes, protect)
    if target.directory is None:
        scratch = files[0].parent
        yield Placement(target, scratch, stale=remove_stale_temps(scratch))
        return
    directory = target.directory
    assert found is not None
    with DirTransaction(directory, force=force, protected=protected) as temp:
        inside = [temp / f.name for f in files]
        needed = needed_bytes + found.nbytes
        preflight(inside, [], force=False, needed_bytes=needed)
        placed = Target(tuple(temp / p.name for p in target.shard_outputs), temp)
        yield Placement(placed, directory.parent, list(found.notes), companions=found)


def check_outputs(
    source: Source,
    target: Target,
    layout: Callable[[Path], list[Path]],
    force: bool,
    also: Sequence[Path] = (),
    needed_bytes: int = 0,
    *,
    protect: Sequence[Path] = (),
) -> None:
    """Every check `prepared` makes before it writes (what a dry run checks), writing nothing."""
    _checked(source, target, layout, force, also, needed_bytes, protect)


def _checked(
    source: Source,
    target: Target,
    layout: Callable[[Path], list[Path]],
    force: bool,
    also: Sequence[Path],
    needed_bytes: int,
    protect: Sequence[Path],
) -> tuple[list[Path], list[Path], Companions | None]:
    """The checks of the outputs (see `prepared`): the protected paths, the output files and,
    for a directory, the companions to copy along."""
    protected = [*source.protected, *protect]
    files = [f for out in target.shard_outputs for f in layout(out)]
    if source.directory is not None:  # a new file in a model's directory changes the model
        for p in also:
            refuse_nesting(p, [source.directory])
    if target.directory is None:
        if source.directory is not None:  # one file out of a directory: never inside it
            for f in files:
                refuse_nesting(f, [source.directory])
        preflight([*files, *also], protected, force=force, needed_bytes=needed_bytes)
        return protected, files, None
    directory = target.directory
    if source.directory is None:  # a lone file's directory is its model's, spelled otherwise
        protected.append(source.path.parent)
    found = companions(source)
    index = [source.index.index.name] if source.index is not None else []
    finals = [*files, *(directory / rel for rel in [*found.names, *index])]
    check_out_dir(directory, protected, force)
    _refuse_inside(also, directory)
    _refuse_clashes(also, finals)
    preflight(also, protected, force=force)
    return protected, files, found


def _refuse_inside(also: Sequence[Path], directory: Path) -> None:
    """A file the caller writes afterwards (a plot, a plan file) never goes inside the output
    directory: qtool publishes that directory whole and --force replaces only what its manifest
    lists, so a stray file there would be lost or block the next run."""
    root = Path(os.path.realpath(directory))
    for p in also:
        if Path(os.path.realpath(p)).is_relative_to(root):
            raise OutputError(
                p,
                f"lies inside the output directory {directory}, which qtool writes whole; "
                "choose a path outside it",
            )


def _refuse_clashes(also: Sequence[Path], finals: Sequence[Path]) -> None:
    """A file the caller writes afterwards (a plot) must not land on a file of the directory."""

    def key(p: Path) -> tuple[object, str]:
        return (file_id(p.parent) or os.path.abspath(p.parent), p.name)

    taken = {key(p): p for p in finals}
    for p in also:
        if key(p) in taken:
            raise OutputError(
                p,
                f"two outputs of this run would both be written here (also {taken[key(p)]}); "
                "rename an input or choose other output paths",
            )


def finish_directory(
    outputs: OutputSet,
    source: Source,
    place: Placement,
    files: dict[str, bytes],
    weight_map: dict[str, str],
    total: int,
    section: dict[str, object] | None = None,
) -> None:
    """A directory output's last files: the format's own `files` (config.json), the companions
    they do not replace (with their subdirectories), and for an input with an index, the index
    (last) with the file each tensor is stored in and the format's `section` under the `qtool`
    key."""
    directory = place.target.directory
    if directory is None:
        return
    copy_companions(outputs, source, place.companions, directory, skip=files)
    for name, data in files.items():
        outputs.create(directory / name).write(data)
    if source.index is not None:
        dest = directory / source.index.index.name
        write_index(outputs, source.index, dest, weight_map, total, section)


def write_index(
    outputs: OutputSet,
    index: ShardedInput,
    dest: Path,
    weight_map: dict[str, str],
    total: int,
    section: dict[str, object] | None,
) -> None:
    """The input's index with the new weight map and total size (its other keys carried)."""
    doc = {k: v for k, v in index.raw.items() if k not in ("metadata", "weight_map", "qtool")}
    doc["metadata"] = {**index.metadata, "total_size": total}
    if section:
        doc["qtool"] = section
    doc["weight_map"] = dict(sorted(weight_map.items()))
    data = json.dumps(doc, indent=2, ensure_ascii=False).encode() + b"\n"
    outputs.create(dest, last=True).write(data)
