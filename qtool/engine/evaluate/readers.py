"""QUANT's tensors through qtool's own readers (the format registry's, for whatever `detect`
found), as float values in the dtype a consumer restores (never written to disk)."""

from __future__ import annotations

import torch

from qtool.errors import InputError
from qtool.formats.detect import Detected
from qtool.formats.registry import open_reader


def read_tensors(found: Detected) -> tuple[dict[str, torch.Tensor], bool]:
    """(every tensor of QUANT by name, dequantized to its original dtype; whether any was
    quantized). A sharded set is read shard by shard by its reader."""
    tensors: dict[str, torch.Tensor] = {}
    quantized = False
    reader = open_reader(found)
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
