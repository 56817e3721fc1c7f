"""Writing any reader's tensors back as a float checkpoint (what `qtool dequantize` writes):
safetensors streamed tensor by tensor (tensors that were not quantized byte for byte), or a
torch pickle."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from qtool.dtypes import FLOAT_DTYPES, RESTORE_DTYPES
from qtool.errors import InputError, OutputError
from qtool.formats.base import FloatReader, carried_metadata
from qtool.io.atomic import OutputSet, describe_os_error
from qtool.io.checkpoint import ST_TO_TORCH, TORCH_TO_ST, tensor_bytes
from qtool.io.stformat import build_header
from qtool.io.writer import StreamingWriter
from qtool.results import DequantizedRow


def restored_dtype(reader: FloatReader, name: str, dtype: str) -> str:
    """The dtype a tensor is written in: every float tensor, dequantized or not, as asked
    ('original': as it was), so that the model has one float dtype; the others as stored."""
    if dtype == "original":
        return reader.dtype(name)
    if reader.quantization(name) is None and reader.dtype(name) not in FLOAT_DTYPES:
        return reader.dtype(name)
    return RESTORE_DTYPES[dtype]


def _converted(reader: FloatReader, name: str, written: str) -> bool:
    """Written from values (dequantized, or cast to another float dtype), not byte for byte."""
    return reader.quantization(name) is not None or reader.dtype(name) != written


def write_dense(
    reader: FloatReader,
    out: Path,
    outputs: OutputSet,
    dtype: str,
    names: Sequence[str] | None = None,
) -> list[DequantizedRow]:
    """A float checkpoint of the reader's tensors (or of `names`) with the original names and
    shapes: a torch pickle when `out` ends in .pt/.pth/.bin, else safetensors (streamed;
    tensors that were not quantized byte for byte)."""
    names = list(reader.names if names is None else names)
    if out.suffix.lower() in (".pt", ".pth", ".bin"):
        return _write_pickle(reader, names, out, outputs, dtype)
    if "__metadata__" in names:  # safetensors' key for the file's metadata (a GGUF may use it)
        raise InputError(reader.file_of("__metadata__"), "safetensors reserves this name for "
                         "its metadata; write a .pt file instead", "__metadata__")  # fmt: skip
    specs = [(n, restored_dtype(reader, n, dtype), reader.shape(n)) for n in names]
    header_bytes, header = build_header(specs, carried_metadata(reader.metadata) or None)
    writer = StreamingWriter(outputs.create(out), header_bytes, header, out)
    rows: dict[str, DequantizedRow] = {}
    for entry in header.tensors:
        restored = reader.quantization(entry.name) is not None
        slabs = getattr(reader, "slabs", None)  # a reader giving values a slab at a time (GGUF)
        if slabs is not None:
            parts = slabs(entry.name, ST_TO_TORCH[entry.dtype])
            writer.write_parts(entry.name, (tensor_bytes(t) for t in parts))
        elif _converted(reader, entry.name, entry.dtype):
            data = tensor_bytes(reader.values(entry.name, ST_TO_TORCH[entry.dtype]))
            writer.write(entry.name, data)
        else:
            writer.write(entry.name, reader.raw(entry.name))
        reader.release(entry.name)
        cast = not restored and _converted(reader, entry.name, entry.dtype)
        rows[entry.name] = DequantizedRow(
            entry.name, entry.shape, entry.dtype, restored, entry.nbytes, cast
        )
    writer.finish()
    reader.check_unchanged()
    return [rows[n] for n in names]


def _write_pickle(
    reader: FloatReader, names: Sequence[str], out: Path, outputs: OutputSet, dtype: str
) -> list[DequantizedRow]:
    """torch.save needs the whole state dict in memory; .safetensors output streams instead."""
    state: dict[str, torch.Tensor] = {}
    rows = []
    for name in names:
        restored = reader.quantization(name) is not None
        written = restored_dtype(reader, name, dtype)
        t = reader.values(name, ST_TO_TORCH[written])
        state[name] = t if restored else t.clone()
        cast = not restored and _converted(reader, name, written)
        rows.append(
            DequantizedRow(name, tuple(t.shape), TORCH_TO_ST[t.dtype], restored, t.nbytes, cast)
        )
    reader.check_unchanged()
    try:
        torch.save(state, outputs.create(out))
    except OSError as err:
        raise OutputError(out, f"cannot write: {describe_os_error(err)}") from None
    except RuntimeError as err:  # torch's zip writer reports a failed write as an "enforce fail"
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise OutputError(
            out,
            f"cannot write: torch.save failed ({first}), typically a full disk or a file size "
            "limit; free some space or write elsewhere with -o",
        ) from None
    return rows
