"""QUANT's tensors through qtool's own readers (the format registry's, for whatever `detect`
found), as float values in the dtype a consumer restores (never written to disk)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qtool.errors import InputError
from qtool.formats.detect import Detected
from qtool.formats.registry import open_matching, open_reader


def read_tensors(
    found: Detected, names: Sequence[str] | None = None
) -> tuple[dict[str, torch.Tensor], bool]:
    """(every tensor of QUANT by name, dequantized to its original dtype; whether any was
    quantized). A sharded set is read shard by shard by its reader. With `names` (FLOAT's), a
    format that names tensors its own way (GGUF) is read under those names and in FLOAT's
    layout; what it cannot place keeps its own name, for the caller's check to list."""
    tensors: dict[str, torch.Tensor] = {}
    quantized = False
    reader = open_reader(found) if names is None else open_matching(found, names).reader
    try:
        for name in reader.names:
            if name in tensors:
                raise InputError(
                    reader.file_of(name), "holds a tensor another shard holds too", name
                )
            quantized |= reader.quantization(name) is not None
            tensors[name] = reader.values(name).clone()  # the reader's buffers are reused
            reader.release(name)
        reader.check_unchanged()
    finally:
        reader.close()
    return tensors, quantized
