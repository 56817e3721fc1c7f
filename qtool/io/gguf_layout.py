"""The values a GGUF header declares: metadata values, tensor infos, the header as a whole.

Shared by the parser (gguf_header) and the writer (gguf_write); torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool.gguf_types import GGMLType, ValueType

Value = int | float | bool | str | tuple[str, ...] | np.ndarray


@dataclass(frozen=True, eq=False)
class GGUFValue:
    """One metadata value with its GGUF type; an ARRAY holds `item_type` items: a tuple of str
    or a read-only 1-D numpy array of the item type (bool as numpy bool). No `==`: arrays."""

    type: ValueType
    value: Value
    item_type: ValueType | None = None


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor: `shape` in GGUF order (shape[0] = ne[0], the contiguous row), `offset` from
    the start of the data section. torch's shape is the reverse."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


@dataclass(frozen=True)
class GGUFHeader:
    """A validated header: metadata in file order, tensors in file (= data) order."""

    version: int
    metadata: dict[str, GGUFValue]
    tensors: tuple[GGUFTensorInfo, ...]
    alignment: int
    data_start: int  # absolute offset of the data section

    def by_name(self) -> dict[str, GGUFTensorInfo]:
        return {t.name: t for t in self.tensors}


def tensor_nbytes(type_: GGMLType, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` (GGUF order; shape[0] a multiple of the block size)."""
    n = type_.row_bytes(shape[0] if shape else 1)
    for d in shape[1:]:
        n *= d
    return n


def align(n: int, alignment: int) -> int:
    return n + (-n % alignment)
