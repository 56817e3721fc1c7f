"""The index of a sharded safetensors checkpoint (`*.safetensors.index.json`): strict parsing and
validation of every shard it names, from headers alone (torch-free). The directory is opened
once and every file in it is read through that descriptor (safeopen.InputDir)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

from qtool.errors import InputError
from qtool.io.jsonfile import read_json_object
from qtool.io.safeopen import InputDir
from qtool.io.stformat import HeaderError, read_header_file

INDEX_SUFFIX = ".safetensors.index.json"
MAX_INDEX_BYTES = 100_000_000


@dataclass(frozen=True)
class ShardedInput:
    index: Path
    weight_map: dict[str, str]  # tensor name -> shard file name
    metadata: dict[str, object]
    raw: dict[str, object]  # the whole index document, for keys we carry along
    within: InputDir = field(repr=False, compare=False)  # the directory, held open

    @property
    def directory(self) -> Path:
        return self.index.parent

    @property
    def shards(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


def find_index(path: Path, within: InputDir | None = None) -> Path:
    """The index file named by `path`, or the single one inside the directory `path`
    (listed through `within`, that directory held open, when given)."""
    if path.name.endswith(INDEX_SUFFIX) and not path.is_dir():
        if within is None and not os.path.lexists(path):
            raise InputError(path, "no such file or directory; check the path")
        return path  # anything but a regular file is refused when it is read
    if within is None and not path.is_dir():
        if not os.path.lexists(path):
            raise InputError(path, "no such file or directory; check the path")
        return path
    directory = within or InputDir(path)
    found = [n for n in directory.names() if n.endswith(INDEX_SUFFIX)]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise InputError(
            path, f"{what} *{INDEX_SUFFIX} files in this directory; give the index file itself"
        )
    return directory.path / found[0]


def check_inside(directory: Path | InputDir, path: Path) -> None:
    """Refuse a shard, index or sidecar of a checkpoint directory that is a symlink leading
    out of it, or not a regular file (a missing one is left to the caller to report)."""
    within = directory if isinstance(directory, InputDir) else InputDir(directory)
    if within.exists(path.name):
        within.open(path.name).close()


def load_index(path: Path, within: InputDir | None = None) -> ShardedInput:
    """Parse and validate an index and every shard header it names (no tensor data is read);
    every file is opened through the directory's descriptor (`within`, or opened here)."""
    named = within is None and not path.is_dir()  # an index you name may be a link
    index = find_index(path, within)
    within = within or InputDir(index.parent)
    doc = read_json_object(
        index, within=None if named else within, limit=MAX_INDEX_BYTES, what="index"
    )
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InputError(index, "not a valid index: 'weight_map' must map tensor names to files")
    if not weight_map:
        raise InputError(index, "not a valid index: 'weight_map' names no tensor")
    metadata = doc.get("metadata")
    if not isinstance(metadata, dict):
        metadata = {}
    sharded = ShardedInput(index, dict(weight_map), dict(metadata), dict(doc), within)
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
        if not sharded.within.exists(shard):
            raise InputError(shard_path, "shard named by the index is missing")
        try:
            with sharded.within.open(shard) as f:
                header = read_header_file(f)
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
