"""What a run reads: the checkpoint `detect` found (formats/detect.py), as a list of shards.

A lone file is a one-shard source; a sharded checkpoint is its index and shards; a model
directory is its one weight file. A directory is opened once and every file in it (index,
shards, companions) is read through that descriptor (safeopen.InputDir). Its other files
(config, tokenizer, module subdirectories) are the companions a directory output carries
along (engine/companions.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.errors import InputError
from qtool.formats.detect import Detected, already_quantized, detect
from qtool.formats.registry import belongings, entry
from qtool.io.index import ShardedInput
from qtool.io.safeopen import InputDir
from qtool.io.stformat import Header, read_header, read_header_file

if TYPE_CHECKING:
    from qtool.io.checkpoint import Checkpoint

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


@dataclass(frozen=True)
class Source:
    """The checkpoint a run reads; `config` is the model's config.json (`--config`, or the
    directory's; None: a lone file without one)."""

    found: Detected
    config: Path | None = None
    config_given: bool = False  # --config names it (read by path); else read via `within`

    @property
    def path(self) -> Path:
        """What the summary names: the file, the index, or a model directory's weight file."""
        return self.found.named

    @property
    def shards(self) -> tuple[Path, ...]:
        return self.found.weights

    @property
    def index(self) -> ShardedInput | None:
        return self.found.index

    @property
    def directory(self) -> Path | None:
        """The checkpoint directory (None: a lone file)."""
        return self.found.directory

    @property
    def within(self) -> InputDir | None:
        """The checkpoint directory, held open, that every shard is read through (None: a
        lone file, opened by the path you gave)."""
        return self.found.within

    @property
    def config_dir(self) -> InputDir | None:
        """The directory handle config.json is read through (None: --config, by its path)."""
        return None if self.config_given else self.within

    def header(self, shard: Path) -> Header:
        """The shard's validated header (HeaderError when it is not valid safetensors)."""
        if self.found.header is not None and shard == self.found.path:
            return self.found.header  # detect read it already
        if self.within is None:
            return read_header(shard)
        with self.within.open(shard.name) as f:
            return read_header_file(f)

    def checkpoint(self, shard: Path) -> Checkpoint:
        """The shard opened for reading (through the directory, for a checkpoint directory)."""
        from qtool.io.checkpoint import open_checkpoint  # imports torch: header-only runs don't

        return open_checkpoint(shard, self.within)

    def shard_holding(self, name: str) -> Path | None:
        """The shard that holds tensor `name` (None: the index lists no such tensor)."""
        if self.index is None:
            return self.shards[0]
        shard = self.index.weight_map.get(name)
        return None if shard is None else self.index.directory / shard

    @property
    def protected(self) -> list[Path]:
        """What no output may replace, be, contain or lie inside: the directory and everything
        in it, the inputs, the files that belong to them (sidecars), the config."""
        files = [*self.shards]
        if self.config is not None:
            files.append(self.config)
        if self.directory is None:
            return protected_paths(files)
        assert self.within is not None
        inside = [*files, *map(self.within.file, self.within.names())]
        return [self.directory, self.path, *protected_paths(inside)]


def protected_paths(inputs: Iterable[Path]) -> list[Path]:
    """The inputs and what belongs to each (a qtool file's sidecar): no output may replace them."""
    inputs = list(inputs)
    return [*inputs, *belongings(inputs)]


def open_source(path: Path, config: Path | None = None, *, requantize: bool = False) -> Source:
    """The float checkpoint at `path` (a file, a sharded checkpoint, a model directory) with
    its config.json (`config`, else the directory's); InputError when it is already quantized
    (`requantize`: a quantized GGUF is taken, read as float through its reader)."""
    found = detect(path)
    if entry(found.format).not_a_checkpoint:
        raise InputError(path, entry(found.format).not_a_checkpoint)
    if found.quantized and not (requantize and entry(found.format).float_output):
        fmt = entry(found.format)
        err = already_quantized(path, found.description, fmt.suffix if fmt.float_output else "")
        if fmt.float_output:  # GGUF: llama-quantize's way too, quantizing again on request
            err.hints = ("allow-requantize",)
        raise err
    if found.quantized and found.header is not None:  # requantize: planned as the F32 copy
        from qtool.io.gguf_checkpoint import as_float_header

        found = replace(found, header=as_float_header(found.header))
    return Source(found, config or found.config_path, config is not None)
