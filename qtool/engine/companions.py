"""What a directory output carries along from its input directory besides the weights.

Top level: every regular file that is not a weight file, an index or hidden (config, tokenizer,
chat template; a symlink only to a file beside it, see safeopen.InputDir).
Subdirectories: each module directory modules.json names (sentence-transformers: `1_Pooling/`,
`2_Normalize/`, `2_Dense/` with its own float weights), and every other one that holds no weight
file (`additional_chat_templates/`). A directory of weights that is no module (`onnx/`,
`checkpoint-500/`) holds the float model in another form, or another checkpoint: not copied.
Hidden ones are skipped like hidden files, and so is one named like a weight file or an index
(`extra.safetensors/`): in the output root it would clash with the weights qtool writes. They
are walked through descriptors (never through a symlink, never onto another filesystem:
InputDir.subdir), at most MAX_DEPTH levels deep, listing at most MAX_ENTRIES entries and copying
at most MAX_BYTES bytes in all; each file by the rules of the top level. Every file or directory
not copied gets a note saying why. A file is copied through the descriptors again and must still
be the size it was listed with.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from qtool.engine.source import WEIGHT_SUFFIXES, Source
from qtool.errors import InputError, OutputError
from qtool.io.atomic import OutputSet, describe_os_error
from qtool.io.index import INDEX_SUFFIX
from qtool.io.jsonfile import read_json
from qtool.io.safeopen import InputDir, Refused

MAX_DEPTH = 4  # directory levels below the model directory (1_Pooling/ is one)
MAX_ENTRIES = 10_000  # entries listed in all subdirectories together
MAX_BYTES = 4 << 30  # bytes copied from all subdirectories together
MODULES_JSON = "modules.json"
OTHER_WEIGHTS = (*WEIGHT_SUFFIXES, ".onnx", ".onnx_data", ".msgpack", ".h5", ".tflite", ".ot")
"""Files that make a subdirectory a store of weights (another format, another checkpoint)."""
NAMED_LIKE_WEIGHTS = (
    "a directory named like a weight file or an index; in the export it would sit among the "
    "files qtool writes and be taken for one of them"
)


@dataclass(frozen=True)
class Companions:
    """The files to copy by relative path (`1_Pooling/config.json`) with their sizes, the
    subdirectories to create (parents first), and a note for everything left behind."""

    files: tuple[tuple[str, int], ...] = ()
    directories: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files)

    @property
    def names(self) -> list[str]:
        return [rel for rel, _ in self.files]


@dataclass
class _Walk:
    """What the walk found so far, and what it may still list and copy."""

    files: list[tuple[str, int]] = field(default_factory=list)
    directories: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    entries: int = 0
    nbytes: int = 0
    weights: list[str] = field(default_factory=list)  # weight files seen in the current tree


def companions(source: Source) -> Companions:
    """Everything of the checkpoint directory a directory output carries along (module doc)."""
    within = source.within
    if source.directory is None or within is None:
        return Companions()
    walk = _Walk()
    modules = _module_directories(within, walk)
    for name in within.names():
        if name.startswith("."):
            continue
        weighty = name.endswith(WEIGHT_SUFFIXES) or name.endswith(INDEX_SUFFIX)
        if within.is_dir(name):
            if weighty:
                walk.notes.append(f"{within.file(name)}/: not copied: {NAMED_LIKE_WEIGHTS}")
            else:
                _subdirectory(within, name, name in modules, walk)
        elif not weighty:
            _file(within, name, name, walk, top=True)
    return Companions(tuple(walk.files), tuple(walk.directories), tuple(walk.notes))


def _module_directories(within: InputDir, walk: _Walk) -> set[str]:
    """The top-level directories modules.json names (sentence-transformers' module paths)."""
    if not within.exists(MODULES_JSON):
        return set()
    path = within.file(MODULES_JSON)
    try:
        doc = read_json(path, within=within, what=MODULES_JSON)
    except InputError as err:
        walk.notes.append(f"{err}; its module directories are copied only if they hold no weights")
        return set()
    found = set()
    for module in doc if isinstance(doc, list) else []:
        rel = module.get("path") if isinstance(module, dict) else None
        parts = rel.split("/") if isinstance(rel, str) and rel else []
        if parts and all(p not in ("", ".", "..") and "\0" not in p for p in parts):
            found.add(parts[0])
        elif rel not in ("", None):
            walk.notes.append(f"{path}: module path {rel!r} is not a path inside the directory")
    return found


def _subdirectory(parent: InputDir, name: str, module: bool, walk: _Walk) -> None:
    """`name` and what it holds, unless it holds weights and is no module directory."""
    before = (len(walk.files), len(walk.directories), walk.nbytes)
    walk.weights = []
    _tree(parent, name, name, 1, walk)
    if walk.weights and not module:
        del walk.files[before[0] :], walk.directories[before[1] :]
        walk.nbytes = before[2]
        walk.notes.append(
            f"{parent.file(name)}/: not copied: holds weights ({walk.weights[0]}), which are "
            "not part of the model qtool exports (another format or checkpoint)"
        )


def _tree(parent: InputDir, name: str, rel: str, depth: int, walk: _Walk) -> None:
    path = parent.file(name)
    if depth > MAX_DEPTH:
        walk.notes.append(f"{path}/: not copied: deeper than {MAX_DEPTH} levels")
        return
    try:
        within = parent.subdir(name)
    except Refused as why:
        walk.notes.append(f"{path}/: not copied: {why}")
        return
    try:
        walk.directories.append(rel)
        for entry in within.names():
            walk.entries += 1
            if walk.entries > MAX_ENTRIES:
                walk.notes.append(f"{path}/{entry}: not copied: over {MAX_ENTRIES:,} entries")
                return
            if entry.startswith("."):
                continue
            if within.is_dir(entry):
                _tree(within, entry, f"{rel}/{entry}", depth + 1, walk)
            else:
                _file(within, entry, f"{rel}/{entry}", walk, top=False)
    finally:
        within.close()


def _file(within: InputDir, name: str, rel: str, walk: _Walk, *, top: bool) -> None:
    """A file to copy, or a note saying why not."""
    why = within.problem(name)
    try:
        size = _size(within, name) if why is None else 0
    except FileNotFoundError:
        why = "no such file"
    except Refused as refused:
        why = str(refused)
    if why is not None:
        walk.notes.append(f"{within.file(name)}: not copied: {why}")
        return
    if not top:
        if name.endswith(OTHER_WEIGHTS):
            walk.weights.append(rel)
        if walk.nbytes + size > MAX_BYTES:
            walk.notes.append(
                f"{within.file(name)}: not copied: over the {MAX_BYTES >> 30} GiB qtool copies "
                "from subdirectories"
            )
            return
        walk.nbytes += size
    walk.files.append((rel, size))


def _size(within: InputDir, name: str) -> int:
    fd = within.open_fd(name)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


# ---------------------------------------------------------------- copying


def copy_companions(
    outputs: OutputSet, source: Source, found: Companions, directory: Path, skip: Collection[str]
) -> None:
    """Create the subdirectories in `directory` (being built, ours) and copy every file but
    those in `skip` (the format's own files), each through the input's descriptors."""
    within = source.within
    if within is None:
        return
    for rel in found.directories:
        try:
            os.mkdir(directory / rel)
        except OSError as err:
            raise OutputError(directory / rel, f"cannot create: {describe_os_error(err)}") from err
    for rel, size in found.files:
        if rel not in skip:
            with _parent_of(within, rel) as (parent, name):
                _copy(outputs, parent, name, size, directory / rel)


@contextmanager
def _parent_of(within: InputDir, rel: str) -> Iterator[tuple[InputDir, str]]:
    """The directory holding `rel`, opened again component by component (never a link)."""
    *dirs, name = rel.split("/")
    opened: list[InputDir] = []
    current = within
    try:
        for part in dirs:
            try:
                current = current.subdir(part)
            except Refused as why:
                raise InputError(current.file(part), f"changed while qtool ran: {why}") from None
            opened.append(current)
        yield current, name
    finally:
        for d in opened:
            d.close()


def _copy(outputs: OutputSet, within: InputDir, name: str, size: int, dest: Path) -> None:
    """Exactly `size` bytes of the regular file `name`, or InputError (it changed meanwhile)."""
    src = within.file(name)
    with within.open(name) as fin:  # a regular file inside, checked on its descriptor
        if os.fstat(fin.fileno()).st_size != size:
            raise InputError(src, "changed while qtool ran (its size); run again")
        fout = outputs.create(dest)
        try:
            shutil.copyfileobj(_Exactly(fin, size, src), fout, 1 << 20)
        except OSError as err:
            if err.errno in _WRITE_ERRORS:  # the disk filled up while copying
                raise OutputError(dest, f"cannot write: {describe_os_error(err)}") from err
            raise InputError(src, f"cannot read: {err.strerror or err}") from err


class _Exactly:
    """A file read as exactly `size` bytes: InputError when it ends sooner (a file that grows
    meanwhile is read no further, so no writer can make the copy endless)."""

    def __init__(self, f: BinaryIO, size: int, path: Path) -> None:
        self._f, self._left, self._path = f, size, path

    def read(self, n: int = -1) -> bytes:
        if self._left <= 0:
            return b""
        chunk = self._f.read(self._left if n < 0 else min(n, self._left))
        if not chunk:
            raise InputError(self._path, "changed while qtool ran (shorter); run again")
        self._left -= len(chunk)
        return chunk


_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
