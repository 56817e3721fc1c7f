"""`qtool dequantize model.Q4_K.gguf -o model.F32.gguf`: a GGUF back to a float GGUF, the way
back from a quantized GGUF to `quantize --format gguf` (which takes float GGUFs only) and to
llama.cpp, which loads it as it loads convert_hf_to_gguf.py's output.

Every metadata value is carried over as llama-quantize carries it (writer.output_metadata:
general.file_type set to the float type most tensors now have, split keys dropped), so the
architecture, hyperparameters and tokenizer survive; names, order, shapes (GGUF order) and
alignment are the input's. Each quantized tensor is written in the float type asked (`--to`;
F32 by default, ggml's compute type, so nothing is rounded a second time); a tensor stored
plain is copied byte for byte, except that `--to` converts those of two or more dimensions
too. One-dimensional tensors (norms, biases) stay as they are, F32 as convert_hf_to_gguf.py
writes them: llama.cpp expects them so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qtool.dtypes import RESTORE_DTYPES
from qtool.errors import OutputError
from qtool.formats.base import FloatReader
from qtool.formats.gguf.ftype import guess_ftype
from qtool.formats.gguf.reader import PLAIN, GGUFFloatReader
from qtool.formats.gguf.writer import output_metadata
from qtool.gguf_types import GGML_TYPES, GGMLType
from qtool.io.atomic import OutputSet, describe_os_error
from qtool.io.checkpoint import tensor_bytes
from qtool.io.gguf_layout import tensor_nbytes
from qtool.io.gguf_write import GGUFStreamWriter, build_header
from qtool.results import DequantizedRow

_FLOATS = ("F32", "F16", "BF16")


def written_type(reader: GGUFFloatReader, name: str, dtype: str) -> GGMLType:
    """The type `name` is written in: a quantized tensor in the float type asked (F32 for
    'original'), a plain one as it is unless `--to` converts it (a float of 2+ dimensions)."""
    own = reader.gguf_type(name)
    target = GGML_TYPES["F32" if dtype == "original" else RESTORE_DTYPES[dtype]]
    if own.name not in PLAIN:
        return target
    if dtype == "original" or own.name not in _FLOATS or len(reader.shape(name)) < 2:
        return own
    return target


def write_float_gguf(
    reader: FloatReader, out: Path, outputs: OutputSet, dtype: str, names: Sequence[str]
) -> list[DequantizedRow]:
    """The float GGUF `out` (a temp file of `outputs`) of the GGUF `reader` opened, every
    tensor of it (`names`: all of them, in file order)."""
    if not isinstance(reader, GGUFFloatReader):
        raise TypeError("a float GGUF is written from a GGUF file")
    infos = [reader.info(n) for n in reader.names]
    if list(names) != reader.names:
        raise ValueError("a float GGUF holds every tensor of its input, in its order")
    types = {i.name: written_type(reader, i.name, dtype) for i in infos}
    file_type = guess_ftype(types[i.name].name for i in infos if len(i.shape) >= 2)
    specs = [(i.name, types[i.name], i.shape) for i in infos]
    raw, layout = build_header(output_metadata(reader.header, file_type), specs)
    try:
        rows = _write(reader, GGUFStreamWriter(outputs.create(out), raw, layout), types)
    except OSError as err:  # a full disk
        raise OutputError(out, f"cannot write: {describe_os_error(err)}") from None
    reader.check_unchanged()
    return rows


def _write(
    reader: GGUFFloatReader, stream: GGUFStreamWriter, types: dict[str, GGMLType]
) -> list[DequantizedRow]:
    rows = []
    infos = [reader.info(n) for n in reader.names]
    for info in infos:
        stored = types[info.name]
        restored = reader.quantization(info.name) is not None
        if stored == info.type:
            stream.write(reader.raw(info.name))
        else:
            slabs = reader.slabs(info.name, PLAIN[stored.name])
            stream.write_parts(tensor_bytes(t) for t in slabs)
        nbytes = tensor_nbytes(stored, info.shape)
        cast = not restored and stored != info.type
        rows.append(
            DequantizedRow(info.name, info.torch_shape, stored.name, restored, nbytes, cast)
        )
    stream.finish()
    return rows
