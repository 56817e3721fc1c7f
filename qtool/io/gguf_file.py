"""An open GGUF file: its validated header and memory-mapped, read-only tensor data.

    with GGUFFile(path) as f:
        for info in f.header.tensors:
            raw = f.tensor_bytes(info)     # uint8 view of the file, no copy
            arr = f.tensor_array(info)     # typed view in torch order, or raw blocks

A file that is not a valid GGUF is refused with an InputError naming it and saying what is
wrong (the parse is gguf_header's). The mapping stays valid while views of it live.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path
from types import TracebackType

import numpy as np

from qtool.errors import InputError
from qtool.io.gguf_header import GGUFHeaderError, parse_header
from qtool.io.gguf_layout import GGUFHeader, GGUFTensorInfo
from qtool.io.safeopen import open_regular

# ggml types whose elements are plain little-endian numbers
_NUMPY = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "i1", "I16": "<i2", "I32": "<i4",
          "I64": "<i8"}  # fmt: skip


class GGUFFile:
    """A GGUF file opened read-only: `header` and zero-copy access to each tensor's bytes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open_regular(self.path) as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise InputError(self.path, "not a valid GGUF file: it is empty")
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as err:
                raise InputError(self.path, f"cannot map: {err.strerror or err}") from None
        try:
            self.header: GGUFHeader = parse_header(memoryview(self._map))
        except GGUFHeaderError as err:
            self.close()
            raise InputError(self.path, f"not a valid GGUF file: {err}") from None

    def tensor_bytes(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's raw data: a read-only uint8 view of `nbytes` bytes."""
        start = self.header.data_start + info.offset
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=start)

    def tensor_array(self, info: GGUFTensorInfo) -> np.ndarray:
        """A read-only view in torch order: typed for float/int types (BF16 as its uint16
        bits, numpy has no bfloat16), else uint8 rows of blocks (..., row_bytes)."""
        raw = self.tensor_bytes(info)
        rows = info.torch_shape[:-1] if info.shape else ()
        dtype = _NUMPY.get(info.type.name)
        if dtype is not None:
            return raw.view(dtype).reshape(info.torch_shape)
        if info.type.name == "BF16":
            return raw.view("<u2").reshape(info.torch_shape)
        return raw.reshape(*rows, info.type.row_bytes(info.shape[0] if info.shape else 1))

    def close(self) -> None:
        """Unmap now, unless views are still alive (then when the last one goes)."""
        with contextlib.suppress(BufferError):
            self._map.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
