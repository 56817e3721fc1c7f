"""Model-directory outputs (compressed-tensors): a Hugging Face model directory in, one out.

The input is a model directory (config.json and one safetensors file, or shards with an index)
or a single safetensors file with `--config`. The output directory is built under a temporary
name beside its final one and renamed when complete, so it appears whole or not at all. It holds
one shard per input shard under the same name (a single file becomes `model.safetensors`), the
format's own files (config.json), every other file of the input directory, and a rewritten index
when the input had one.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from qtool.engine.source import Source, Target, companions_in, copy_into, open_source
from qtool.errors import InputError, OutputError, UsageError
from qtool.io.atomic import OutputSet
from qtool.io.index import INDEX_SUFFIX, find_index

SINGLE_SHARD_NAME = "model.safetensors"


@dataclass(frozen=True)
class ModelInput:
    """A model to export: its shards, its config.json, the directory its companions are in."""

    source: Source
    config: Path
    directory: Path | None  # None: a single file given with --config (no companions)


def open_model(src: Path, config: Path | None) -> ModelInput:
    """The model at `src`: a directory (with an index, or one model.safetensors), or a single
    .safetensors file with `config` (InputError/UsageError saying what is missing)."""
    if src.is_dir():
        has_index = any(p.name.endswith(INDEX_SUFFIX) for p in src.iterdir())
        source = open_source(find_index(src)) if has_index else _single(src / SINGLE_SHARD_NAME)
        return ModelInput(source, config or src / "config.json", src)
    if src.name.endswith(INDEX_SUFFIX):
        source = open_source(src)
        return ModelInput(source, config or src.parent / "config.json", src.parent)
    if config is None:
        raise UsageError(
            src,
            "a single file needs the model's config.json for a compressed-tensors export; "
            "pass --config PATH, or give the model directory",
            hint="config",
        )
    return ModelInput(_single(src), config, None)


def _single(path: Path) -> Source:
    if not path.is_file():
        raise InputError(
            path, "no such file; a model directory holds model.safetensors or an index"
        )
    if not path.name.endswith(".safetensors"):
        raise InputError(path, "a compressed-tensors export reads .safetensors checkpoints only")
    return Source(path, (path,))


def model_target(model: ModelInput, directory: Path) -> Target:
    """One output shard per input shard in `directory`, under the same name."""
    if model.source.index is None:
        return Target((directory / SINGLE_SHARD_NAME,), directory)
    return Target(tuple(directory / s.name for s in model.source.shards), directory)


def companions(model: ModelInput) -> tuple[list[Path], list[str]]:
    """The input directory's other files (see companions_in), and a note per file skipped."""
    if model.directory is None:
        return [], []
    return companions_in(model.directory)


def check_output_dir(out: Path, model: ModelInput, force: bool) -> None:
    """Before anything is read: the output directory can be made (or replaced with force)."""
    inputs = [model.source.path, *(model.directory or model.source.path.parent,)]
    if out.exists() and any(os.path.samefile(out, p) for p in inputs if p.exists()):
        raise OutputError(out, "is the input directory; choose another -o")
    if out.exists() and not out.is_dir():
        raise OutputError(out, "exists and is not a directory; choose a directory name with -o")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputError(
            out, "already exists and is not empty; it is replaced only when asked", hint="force"
        )
    if not out.parent.is_dir():
        raise OutputError(out, f"directory {out.parent} does not exist; create it first")
    if not os.access(out.parent, os.W_OK):
        raise OutputError(out, f"directory {out.parent} is not writable")


@contextmanager
def building(out: Path) -> Iterator[Path]:
    """A temporary directory beside `out` to build in; renamed to `out` when the body succeeds
    (an existing `out` is replaced), removed when it fails."""
    temp = out.parent / f".{out.name}.qtool-tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        temp.mkdir()
    except OSError as err:
        raise OutputError(
            out, f"cannot create a directory in {out.parent}: {err.strerror}"
        ) from None
    try:
        yield temp
        _replace_dir(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _replace_dir(temp: Path, out: Path) -> None:
    if not out.exists():
        os.rename(temp, out)
        return
    old = out.parent / f".{out.name}.qtool-old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(out, old)
    try:
        os.rename(temp, out)
    except OSError:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


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
            copy_into(outputs, companion, directory / companion.name)
    index = model.source.index
    if index is None:
        return
    doc = {k: v for k, v in index.raw.items() if k not in ("metadata", "weight_map", "qtool")}
    doc["metadata"] = {**index.metadata, "total_size": total}
    doc["weight_map"] = dict(sorted(weight_map.items()))
    data = json.dumps(doc, indent=2, ensure_ascii=False).encode() + b"\n"
    outputs.create(directory / index.index.name, last=True).write(data)
