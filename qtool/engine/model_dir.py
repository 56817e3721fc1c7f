"""Model-directory outputs (compressed-tensors): a Hugging Face model directory in, one out.

The input is a model directory (config.json and one safetensors file, or shards with an index)
or a single safetensors file with `--config`; a directory is opened once and every file in it
(config, index, shards, companions) is read through that descriptor (safeopen.InputDir). The
output directory is built by an outdir.DirTransaction: under a locked temporary name beside its
final one, published without replacing anything but a previous qtool export (with force), so it
appears whole or not at all and never costs the user a file qtool did not write. It holds
one shard per input shard under the same name (a single file becomes `model.safetensors`), the
format's own files (config.json), every other file of the input directory, and a rewritten index
when the input had one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from qtool.engine.source import (
    Source,
    Target,
    companions_in,
    companions_nbytes,
    copy_into,
    open_sharded,
    open_source,
)
from qtool.errors import InputError, UsageError
from qtool.io.atomic import OutputSet
from qtool.io.index import INDEX_SUFFIX, find_index
from qtool.io.outdir import DirTransaction, check_out_dir
from qtool.io.safeopen import InputDir

SINGLE_SHARD_NAME = "model.safetensors"


@dataclass(frozen=True)
class ModelInput:
    """A model to export: its shards, its config.json, the directory its companions are in."""

    source: Source
    config: Path
    directory: Path | None  # None: a single file given with --config (no companions)
    within: InputDir | None = field(default=None, repr=False, compare=False)
    config_given: bool = False  # --config names it (read by path); else read via `within`

    @property
    def config_dir(self) -> InputDir | None:
        """The directory handle config.json is read through (None: --config, by its path)."""
        return None if self.config_given else self.within

    @property
    def protected(self) -> list[Path]:
        """What no output directory may be, contain or lie inside: the input (directory or
        file), its index and shards, and the config; for a single file, its directory too
        (the model's directory spelled otherwise)."""
        inputs = [self.source.path, *self.source.shards, self.config]
        return [self.directory or self.source.path.parent, *inputs]


def open_model(src: Path, config: Path | None) -> ModelInput:
    """The model at `src`: a directory (with an index, or one model.safetensors), or a single
    .safetensors file with `config` (InputError/UsageError saying what is missing). A directory
    is opened once; everything in it is read through that descriptor."""
    if src.is_dir():
        within = InputDir(src)
        if any(n.endswith(INDEX_SUFFIX) for n in within.names()):
            source = open_sharded(find_index(src, within), within)
        else:
            source = _single(src / SINGLE_SHARD_NAME, within)
        return ModelInput(source, config or src / "config.json", src, within, config is not None)
    if src.name.endswith(INDEX_SUFFIX):
        source = open_source(src)
        directory = src.parent
        return ModelInput(
            source,
            config or directory / "config.json",
            directory,
            source.within,
            config is not None,
        )
    if config is None:
        raise UsageError(
            src,
            "a single file needs the model's config.json for a compressed-tensors export; "
            "pass --config PATH, or give the model directory",
            hint="config",
        )
    return ModelInput(_single(src), config, None, None, True)


def _single(path: Path, within: InputDir | None = None) -> Source:
    if within is not None and not within.exists(path.name):
        raise InputError(
            path, "no such file; a model directory holds model.safetensors or an index"
        )
    if within is None and not path.is_file():
        raise InputError(
            path, "no such file; a model directory holds model.safetensors or an index"
        )
    if not path.name.endswith(".safetensors"):
        raise InputError(path, "a compressed-tensors export reads .safetensors checkpoints only")
    return Source(path, (path,), directory=within)


def model_target(model: ModelInput, directory: Path) -> Target:
    """One output shard per input shard in `directory`, under the same name."""
    if model.source.index is None:
        return Target((directory / SINGLE_SHARD_NAME,), directory)
    return Target(tuple(directory / s.name for s in model.source.shards), directory)


def companions(model: ModelInput) -> tuple[list[Path], list[str]]:
    """The input directory's other files (see companions_in), and a note per file skipped."""
    if model.within is None:
        return [], []
    return companions_in(model.within)


def companions_bytes(model: ModelInput) -> int:
    """Bytes the copied companions take in the output (for the free-space check)."""
    return companions_nbytes(model.within, companions(model)[0])


def check_output_dir(out: Path, model: ModelInput, force: bool) -> None:
    """Before anything is read: the output directory can be made, or (with force) replaces a
    previous qtool export only; never an input, its directory or the config, nor anything
    containing one or inside one (outdir.check_out_dir)."""
    check_out_dir(out, model.protected, force)


@contextmanager
def building(out: Path, model: ModelInput | None = None, force: bool = False) -> Iterator[Path]:
    """A temporary directory beside `out` to build in (locked for its life); published as
    `out` when the body succeeds (outdir.DirTransaction: nothing that appeared meanwhile is
    replaced, only a previous qtool export with force), removed when it fails."""
    protected = model.protected if model is not None else []
    with DirTransaction(out, force=force, protected=protected) as temp:
        yield temp


def finish_model_directory(
    outputs: OutputSet,
    model: ModelInput,
    directory: Path,
    files: dict[str, bytes],
    weight_map: dict[str, str],
    total: int,
) -> None:
    """Write the format's files, copy the companions they do not replace, and (sharded input)
    the index with the new tensor names, last."""
    for name, data in files.items():
        outputs.create(directory / name).write(data)
    for companion in companions(model)[0]:
        if companion.name not in files:
            copy_into(outputs, companion, directory / companion.name, model.within)
    index = model.source.index
    if index is None:
        return
    doc = {k: v for k, v in index.raw.items() if k not in ("metadata", "weight_map", "qtool")}
    doc["metadata"] = {**index.metadata, "total_size": total}
    doc["weight_map"] = dict(sorted(weight_map.items()))
    data = json.dumps(doc, indent=2, ensure_ascii=False).encode() + b"\n"
    outputs.create(directory / index.index.name, last=True).write(data)
