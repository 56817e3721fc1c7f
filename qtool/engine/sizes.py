"""How many bytes a tensor takes as stored: its codes (4-bit packed two per byte), the sidecar's
qparams, a GGUF type's blocks (scales inside), or what a format says it stores (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qtool.dtypes import DTYPE_BITS
from qtool.io.stformat import TensorEntry
from qtool.spec import Codec


@dataclass(frozen=True)
class Stored:
    """How a format other than qtool's stores a quantized tensor: its bytes and its codes' dtype."""

    nbytes: int
    dtype: str


def stored_dtype(entry: TensorEntry, spec: Codec | None, stored: Stored | None = None) -> str:
    """The dtype the tensor is stored as: the format's, its codes', or its own when kept."""
    if stored is not None:
        return stored.dtype
    return spec.stored_dtype() if spec is not None else entry.dtype


def stored_nbytes(entry: TensorEntry, spec: Codec | None, stored: Stored | None = None) -> int:
    """Bytes of the tensor as stored: 4-bit codes are packed two per byte along the last
    dimension; a format that says how many bytes it stores is taken at its word."""
    if stored is not None:
        return stored.nbytes
    if spec is not None:
        return spec.code_nbytes(entry.shape)
    return math.prod(entry.shape) * DTYPE_BITS[entry.dtype] // 8


def qparam_nbytes(entry: TensorEntry, spec: Codec | None, stored: Stored | None = None) -> int:
    """Bytes the tensor adds to the sidecar: a float32 scale and a 1-byte zero point per group,
    and with --range mse the 1-byte index of the range each group kept (0 when kept, or when the
    format counts its qparams in its stored bytes)."""
    if spec is None or stored is not None:
        return 0
    return spec.sidecar_nbytes(entry.shape)
