"""QUANT's tensors through qtool's own readers, as float values in the dtype a consumer
restores (never written to disk). `open_readers` is the one place that picks a reader: point it
at the format registry's detect(path) when that lands."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from qtool.errors import InputError
from qtool.formats import open_reader
from qtool.formats.base import FloatReader
from qtool.io.index import INDEX_SUFFIX, load_index


def open_readers(path: Path) -> Iterator[FloatReader]:
    """A reader per file of QUANT, opened one after the other (the caller closes each): a
    single file (a qtool-quantized one with its sidecar, or a float checkpoint), each shard of
    a sharded set (its index, or the directory holding it), or a model directory with one
    model.safetensors."""
    sharded = path.name.endswith(INDEX_SUFFIX) or (
        path.is_dir() and any(p.name.endswith(INDEX_SUFFIX) for p in path.iterdir())
    )
    if not sharded:
        yield open_reader(path)
        return
    index = load_index(path)
    for shard in index.shards:
        yield open_reader(index.directory / shard)


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """(every tensor of QUANT by name, dequantized to its original dtype; whether any was
    quantized)."""
    tensors: dict[str, torch.Tensor] = {}
    quantized = False
    for reader in open_readers(path):
        try:
            for name in reader.names:
                if name in tensors:
                    raise InputError(reader.path, "holds a tensor another shard holds too", name)
                quantized |= reader.quantization(name) is not None
                tensors[name] = reader.values(name).clone()  # the reader's buffers are reused
                reader.release(name)
        finally:
            reader.close()
    return tensors, quantized
