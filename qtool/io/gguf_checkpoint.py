"""A GGUF file through the interfaces of a safetensors checkpoint, so that the planner and the
quantize loop read a float GGUF (F32/F16/BF16, as convert_hf_to_gguf.py writes it) as they read
any checkpoint: `entries` lists its tensors as TensorEntry (dtype: the GGUF type's name, "F16";
shape in torch order, GGUF's reversed; offsets from the start of its data section), `as_header`
gives them as a stformat.Header (a dry run plans from it, torch-free), and `open_gguf_data`
opens the file for io.checkpoint.Checkpoint, which reads each tensor with pread through one
descriptor (nothing mapped: a file truncated while open is an error, never
SIGBUS). Quantized GGUF tensors are listed with their type's name ("Q4_K"), which no
checkpoint reader gives values for: quantize refuses such a file before reading it.
"""

from __future__ import annotations

import os
from pathlib import Path

from qtool.gguf_types import GGML_TYPES
from qtool.io.filestamp import FileStamp
from qtool.io.gguf_file import GGUFFile
from qtool.io.gguf_layout import GGUFHeader
from qtool.io.stformat import Header, TensorEntry

MAGIC = b"GGUF"


def entries(header: GGUFHeader) -> tuple[TensorEntry, ...]:
    """Every tensor as a TensorEntry, in file (= data) order."""
    return tuple(
        TensorEntry(t.name, t.type.name, t.torch_shape, t.offset, t.offset + t.nbytes)
        for t in header.tensors
    )


def as_header(header: GGUFHeader) -> Header:
    """The GGUF header as a stformat.Header (no string metadata: GGUF's is typed)."""
    return Header(entries(header), None, header.data_start)


def as_float_header(header: Header) -> Header:
    """`as_header`'s header with each quantized tensor listed as the F32 it dequantizes to
    (offsets kept: a plan from it, never a read; quantize --allow-requantize's dry run)."""
    listed = tuple(
        e if GGML_TYPES[e.dtype].block_size == 1
        else TensorEntry(e.name, "F32", e.shape, e.begin, e.begin + 4 * e.numel)
        for e in header.tensors
    )  # fmt: skip
    return Header(listed, header.metadata, header.data_start)


def open_gguf_data(path: Path) -> tuple[Header, int, FileStamp]:
    """The GGUF file at `path` opened for io.checkpoint.Checkpoint: its header as a stformat
    Header, a descriptor of its own (the caller closes it) and its filestamp.stamp when
    opened; InputError naming it when it is not a valid GGUF file."""
    with GGUFFile(path) as f:
        return as_header(f.header), os.dup(f.fileno()), f.opened_stat
