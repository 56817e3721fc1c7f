"""Writing GGUF files: the header from metadata and tensor specs, then the data, streamed.

    header, layout = build_header(metadata, [(name, ggml_type, shape), ...])
    with OutputSet() as outputs:
        writer = GGUFStreamWriter(outputs.create(path), header, layout)
        for data in tensor_bytes_in_order:
            writer.write(data)          # one tensor at a time, padded to the alignment
        writer.finish()
        outputs.commit()                # temp file + rename (io.atomic)

or `write_gguf(path, metadata, specs, datas)` for all of it. The layout is ggml's (GGUF
version 3, tensors in the given order, each at the aligned end of the one before), so the
header parses back to `layout` with gguf_header.parse_header, and gguf-py reads it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np

from qtool.errors import OutputError
from qtool.gguf_types import (
    ALIGNMENT_KEY,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_VERSION,
    GGMLType,
    ValueType,
    ggml_type,
)
from qtool.io.atomic import OutputSet, describe_os_error
from qtool.io.gguf_header import MAX_ALIGNMENT, MAX_DIMS, MAX_NAME_BYTES
from qtool.io.gguf_layout import GGUFHeader, GGUFTensorInfo, GGUFValue, align, tensor_nbytes

TensorSpec = tuple[str, str | GGMLType, Sequence[int]]  # name, ggml type, shape (GGUF order)
Buffer = bytes | bytearray | memoryview | np.ndarray
_T = TypeVar("_T")


def build_header(
    metadata: Mapping[str, GGUFValue], specs: Iterable[TensorSpec]
) -> tuple[bytes, GGUFHeader]:
    """The header bytes (padded to the alignment when there are tensors) and the layout they
    declare; ValueError for what ggml would refuse to read."""
    alignment = _alignment(metadata)
    out = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, 0, len(metadata))]
    for key, value in metadata.items():
        if not key:
            raise ValueError("a metadata key is empty")
        out += [_string(key), _value(key, value)]
    infos, offset, names = [], 0, set[str]()
    for name, type_key, shape in specs:
        info = _tensor(name, ggml_type(type_key), tuple(int(d) for d in shape), offset, names)
        out.append(_tensor_bytes(info))
        infos.append(info)
        offset = align(offset + info.nbytes, alignment)
    out[1] = struct.pack("<IQQ", GGUF_VERSION, len(infos), len(metadata))
    raw = b"".join(out)
    if infos:
        raw += bytes(-len(raw) % alignment)
    return raw, GGUFHeader(GGUF_VERSION, dict(metadata), tuple(infos), alignment, len(raw))


def _alignment(metadata: Mapping[str, GGUFValue]) -> int:
    value = metadata.get(ALIGNMENT_KEY)
    if value is None:
        return GGUF_DEFAULT_ALIGNMENT
    n = value.value
    if value.type is not ValueType.UINT32 or not isinstance(n, int) or n <= 0 or n & (n - 1):
        raise ValueError(f"{ALIGNMENT_KEY} must be a UINT32 power of 2, not {n!r}")
    if n > MAX_ALIGNMENT:
        raise ValueError(f"{ALIGNMENT_KEY} {n} is over the reader's limit of {MAX_ALIGNMENT}")
    return n


def _tensor(
    name: str, t: GGMLType, shape: tuple[int, ...], offset: int, names: set[str]
) -> GGUFTensorInfo:
    if not name or len(name.encode()) > MAX_NAME_BYTES or name in names:
        raise ValueError(f"tensor name {name!r} is empty, a duplicate or over 63 bytes")
    names.add(name)
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape) or math.prod(shape) >= 1 << 63:
        raise ValueError(f"tensor {name!r}: shape {list(shape)} is not one ggml can hold")
    if (shape[0] if shape else 1) % t.block_size:
        raise ValueError(f"tensor {name!r}: rows of {shape[0]} are not whole {t.name} blocks")
    return GGUFTensorInfo(name, t, shape, offset, tensor_nbytes(t, shape))


def _tensor_bytes(info: GGUFTensorInfo) -> bytes:
    dims = struct.pack(f"<{len(info.shape)}Q", *info.shape)
    return b"".join([_string(info.name), struct.pack("<I", len(info.shape)), dims,
                     struct.pack("<IQ", info.type.id, info.offset)])  # fmt: skip


def _string(s: str) -> bytes:
    raw = s.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError, a ValueError
    return struct.pack("<Q", len(raw)) + raw


def _value(key: str, v: GGUFValue) -> bytes:
    head = struct.pack("<I", v.type)
    try:
        if v.type is ValueType.STRING:
            return head + _string(_as(str, v.value))
        if v.type is not ValueType.ARRAY:
            return head + struct.pack(v.type.struct_format, v.value)
        return head + _array(v)
    except (struct.error, OverflowError, TypeError, UnicodeEncodeError) as err:
        raise ValueError(f"metadata {key!r}: {v.type.name} value {v.value!r:.80}: {err}") from None


def _array(v: GGUFValue) -> bytes:
    item = v.item_type
    if item is None or item is ValueType.ARRAY:
        raise TypeError("an ARRAY needs an item_type other than ARRAY")
    head = struct.pack("<I", item)
    if item is ValueType.STRING:
        items: tuple[object, ...] = _as(tuple, v.value)
        return head + struct.pack("<Q", len(items)) + b"".join(_string(_as(str, s)) for s in items)
    raw = v.value
    # object items keep Python ints exact (2**64 - 1 would become a float in a plain asarray)
    values = raw if isinstance(raw, np.ndarray) else np.asarray(raw, dtype=object)
    try:
        with np.errstate(invalid="ignore", over="ignore"):  # what does not fit is refused below
            packed = values.astype(item.struct_format.replace("?", "b"))
    except (OverflowError, ValueError, TypeError):
        packed = None
    exact = packed is not None and (
        packed.dtype.kind == "f" or bool(np.all(packed.astype(object) == values.astype(object)))
    )
    if values.ndim != 1 or not exact or packed is None:  # floats round to FLOAT32; ints must fit
        raise TypeError(f"items do not fit {item.name}")
    return head + struct.pack("<Q", values.size) + packed.tobytes()


def _as(kind: type[_T], value: object) -> _T:
    if not isinstance(value, kind):
        raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value


class GGUFStreamWriter:
    """Writes `header` to `handle`, then each tensor's data in layout order, padded."""

    def __init__(self, handle: BinaryIO, header: bytes, layout: GGUFHeader) -> None:
        self._handle, self._layout, self._next = handle, layout, 0
        handle.write(header)

    def write(self, data: Buffer) -> None:
        """The next tensor's raw bytes (exactly its nbytes; ValueError otherwise)."""
        if self._next >= len(self._layout.tensors):
            raise ValueError("all tensors of the header are already written")
        info = self._layout.tensors[self._next]
        view = np.ascontiguousarray(data).data if isinstance(data, np.ndarray) else memoryview(data)
        if view.nbytes != info.nbytes:
            raise ValueError(f"tensor {info.name!r}: {view.nbytes} bytes given, {info.nbytes} due")
        self._handle.write(view.cast("B"))
        self._handle.write(bytes(-info.nbytes % self._layout.alignment))
        self._next += 1

    def write_parts(self, parts: Iterable[Buffer]) -> None:
        """The next tensor's raw bytes in pieces (a slab of rows at a time), which together
        are exactly its nbytes (ValueError otherwise, after the pieces given)."""
        if self._next >= len(self._layout.tensors):
            raise ValueError("all tensors of the header are already written")
        info, done = self._layout.tensors[self._next], 0
        for data in parts:
            view = np.ascontiguousarray(data).data if isinstance(data, np.ndarray) else (
                memoryview(data))  # fmt: skip
            done += view.nbytes
            if done > info.nbytes:
                break
            self._handle.write(view.cast("B"))
        if done != info.nbytes:
            raise ValueError(f"tensor {info.name!r}: {done} bytes given, {info.nbytes} due")
        self._handle.write(bytes(-info.nbytes % self._layout.alignment))
        self._next += 1

    def finish(self) -> None:
        """Check that every tensor was written (ValueError naming the first missing one)."""
        if self._next < len(self._layout.tensors):
            raise ValueError(f"tensor {self._layout.tensors[self._next].name!r} was not written")


def write_gguf(
    path: Path,
    metadata: Mapping[str, GGUFValue],
    specs: Sequence[TensorSpec],
    datas: Iterable[Buffer],
) -> GGUFHeader:
    """Write a whole GGUF file atomically (temp file in the target directory, then renamed);
    `datas` yields each tensor's bytes in `specs` order, one at a time. A failed write (a full
    disk, a file-size limit) is OutputError naming `path`, the temp file removed."""
    header, layout = build_header(metadata, specs)
    with OutputSet() as outputs:
        handle = outputs.create(path)
        try:
            writer = GGUFStreamWriter(handle, header, layout)
            for data in datas:
                writer.write(data)
        except OSError as err:
            raise OutputError(path, f"cannot write: {describe_os_error(err)}") from None
        writer.finish()
        outputs.commit()
    return layout
