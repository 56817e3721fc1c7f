"""The index of a sharded safetensors checkpoint (`*.safetensors.index.json`): strict parsing and
validation of every shard it names, from headers alone (torch-free)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from qtool.errors import InputError
from qtool.io.safeopen import file_kind, read_bounded
from qtool.io.stformat import HeaderError, read_header, strict_json

INDEX_SUFFIX = ".safetensors.index.json"
MAX_INDEX_BYTES = 100_000_000


@dataclass(frozen=True)
class ShardedInput:
    index: Path
    weight_map: dict[str, str]  # tensor name -> shard file name
    metadata: dict[str, object]
    raw: dict[str, object]  # the whole index document, for keys we carry along

    @property
    def directory(self) -> Path:
        return self.index.parent

    @property
    def shards(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


def is_sharded(path: Path) -> bool:
    return path.is_dir() or path.name.endswith(INDEX_SUFFIX)


def find_index(path: Path) -> Path:
    """The index file named by `path`, or the single one inside the directory `path`."""
    if not path.is_dir():
        if not os.path.lexists(path):
            raise InputError(path, "no such file or directory; check the path")
        return path  # anything but a regular file is refused when it is read
    found = sorted(p for p in path.iterdir() if p.name.endswith(INDEX_SUFFIX))
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise InputError(
            path, f"{what} *{INDEX_SUFFIX} files in this directory; give the index file itself"
        )
    check_inside(path, found[0])
    return found[0]


def companion_problem(directory: Path, path: Path) -> str | None:
    """Why a file found in a checkpoint directory must not be read or copied, or None: it must
    be a regular file, and a symlink must not lead out of the directory (a link to a secret or
    to /proc would otherwise be copied into the output)."""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            target = os.path.realpath(path)
            if not Path(target).is_relative_to(os.path.realpath(directory)):
                return f"a symlink to {os.readlink(path)}, outside the checkpoint directory"
            st = os.stat(target)
    except OSError as err:
        return f"cannot read: {err.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file ({file_kind(st.st_mode)})"
    return None


def check_inside(directory: Path, path: Path) -> None:
    """Refuse a shard, index or sidecar of a checkpoint directory that is a symlink leading
    out of it, or not a regular file (a missing one is left to the caller to report)."""
    if not os.path.lexists(path):
        return
    why = companion_problem(directory, path)
    if why is not None:
        raise InputError(
            path,
            f"{why}; qtool reads only regular files inside the checkpoint directory "
            "(copy the file in, e.g. cp -L, instead of linking it)",
        )


def load_index(path: Path) -> ShardedInput:
    """Parse and validate an index and every shard header it names (no tensor data is read)."""
    index = find_index(path)
    try:
        doc = strict_json(read_bounded(index, MAX_INDEX_BYTES, "index file"))
    except HeaderError as err:
        raise InputError(index, f"not a valid index: {err}") from None
    if not isinstance(doc, dict):
        raise InputError(index, "not a valid index: expected a JSON object")
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InputError(index, "not a valid index: 'weight_map' must map tensor names to files")
    if not weight_map:
        raise InputError(index, "not a valid index: 'weight_map' names no tensor")
    metadata = doc.get("metadata")
    if not isinstance(metadata, dict):
        metadata = {}
    sharded = ShardedInput(index, dict(weight_map), dict(metadata), dict(doc))
    for shard in sharded.shards:
        _check_shard_name(index, shard)
    _check_shards_agree(sharded)
    return sharded


def _check_shard_name(index: Path, shard: str) -> None:
    """Shards are plain file names beside the index: no paths, no escapes, no pickles."""
    for flavour in (PurePosixPath, PureWindowsPath):
        p = flavour(shard)
        if p.is_absolute() or p.drive or len(p.parts) != 1 or shard in (".", ".."):
            raise InputError(index, f"shard path {shard!r} escapes the checkpoint directory")
    if not shard.endswith(".safetensors"):
        raise InputError(
            index,
            f"shard {shard!r} is not a .safetensors file; a safetensors index never names pickles",
        )


def _check_shards_agree(sharded: ShardedInput) -> None:
    by_shard: dict[str, set[str]] = {shard: set() for shard in sharded.shards}
    for name, shard in sharded.weight_map.items():  # one pass, not one per shard
        by_shard[shard].add(name)
    for shard in sharded.shards:
        shard_path = sharded.directory / shard
        check_inside(sharded.directory, shard_path)
        if not os.path.lexists(shard_path):
            raise InputError(shard_path, "shard named by the index is missing")
        try:
            header = read_header(shard_path)
        except HeaderError as err:
            raise InputError(shard_path, f"not a valid safetensors file: {err}") from None
        in_shard = {t.name for t in header.tensors}
        listed = by_shard[shard]
        _complain(shard_path, "listed in the index but missing from the shard", listed - in_shard)
        _complain(shard_path, "in the shard but not listed for it in the index", in_shard - listed)


def _complain(path: Path, what: str, names: set[str]) -> None:
    if names:
        shown = ", ".join(repr(n) for n in sorted(names)[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        raise InputError(path, f"tensors {what}: {shown}{more}")


def default_output_dir(index: Path, suffix: str) -> Path:
    """`models/llama/` -> `models/llama.int8/` beside it."""
    directory = index.parent.resolve()
    return directory.with_name(f"{directory.name}.{suffix}")
