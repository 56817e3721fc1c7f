"""The GGUF vocabulary: ggml tensor types (block size, bytes per block) and metadata value types.

Torch-free and numpy-free, so a header can be parsed and inspected without either. The ids and
sizes are ggml's (ggml.h `enum ggml_type`, ggml.c `type_traits`), the same as gguf-py's
`GGMLQuantizationType` and `GGML_QUANT_SIZES` (a test compares them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

QK_K = 256  # elements in a K-quant super-block

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3  # what the writer writes; the reader accepts 2 and 3 (same layout)
GGUF_DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type: a row of `block_size` elements takes `type_size` bytes per block.

    Q4_K: 256 elements in 144 bytes, 4.5 bits per weight."""

    id: int
    name: str
    block_size: int
    type_size: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block_size

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of `n` elements (a multiple of block_size)."""
        if n % self.block_size:
            raise ValueError(f"{self.name}: a row of {n} is not a multiple of {self.block_size}")
        return n // self.block_size * self.type_size


def _t(id: int, name: str, block_size: int, type_size: int) -> GGMLType:
    return GGMLType(id, name, block_size, type_size)


_K = QK_K
GGML_TYPES: dict[str, GGMLType] = {t.name: t for t in (
    _t(0, "F32", 1, 4), _t(1, "F16", 1, 2), _t(2, "Q4_0", 32, 18), _t(3, "Q4_1", 32, 20),
    _t(6, "Q5_0", 32, 22), _t(7, "Q5_1", 32, 24), _t(8, "Q8_0", 32, 34), _t(9, "Q8_1", 32, 36),
    _t(10, "Q2_K", _K, 2 + 2 + _K // 16 + _K // 4), _t(11, "Q3_K", _K, 2 + _K // 4 + _K // 8 + 12),
    _t(12, "Q4_K", _K, 2 + 2 + 12 + _K // 2), _t(13, "Q5_K", _K, 2 + 2 + 12 + _K // 8 + _K // 2),
    _t(14, "Q6_K", _K, 2 + _K // 2 + _K // 4 + _K // 16), _t(15, "Q8_K", _K, 4 + _K + _K // 8),
    _t(16, "IQ2_XXS", _K, 2 + _K // 4), _t(17, "IQ2_XS", _K, 2 + _K // 4 + _K // 32),
    _t(18, "IQ3_XXS", _K, 2 + _K // 4 + _K // 8), _t(19, "IQ1_S", _K, 2 + _K // 8 + _K // 16),
    _t(20, "IQ4_NL", 32, 18), _t(21, "IQ3_S", _K, 2 + _K // 4 + _K // 8 + _K // 32 + 4),
    _t(22, "IQ2_S", _K, 2 + _K // 4 + _K // 16), _t(23, "IQ4_XS", _K, 2 + 2 + _K // 2 + _K // 64),
    _t(24, "I8", 1, 1), _t(25, "I16", 1, 2), _t(26, "I32", 1, 4), _t(27, "I64", 1, 8),
    _t(28, "F64", 1, 8), _t(29, "IQ1_M", _K, _K // 8 + _K // 16 + _K // 32), _t(30, "BF16", 1, 2),
    _t(34, "TQ1_0", _K, 2 + 4 * 13), _t(35, "TQ2_0", _K, 2 + 64), _t(39, "MXFP4", 32, 17),
    _t(40, "NVFP4", 64, 36), _t(41, "Q1_0", 128, 18), _t(42, "Q2_0", 64, 18),
)}  # fmt: skip
GGML_TYPES_BY_ID: dict[int, GGMLType] = {t.id: t for t in GGML_TYPES.values()}
FLOAT_TYPES = ("F32", "F16", "BF16")  # unquantized float tensors (F64 is not a weight type)


def ggml_type(key: str | int | GGMLType) -> GGMLType:
    """The type named or numbered `key` (KeyError naming it if ggml has no such type)."""
    if isinstance(key, GGMLType):
        return key
    found = GGML_TYPES_BY_ID.get(key) if isinstance(key, int) else GGML_TYPES.get(key.upper())
    if found is None:
        raise KeyError(f"unknown ggml type {key!r}")
    return found


class ValueType(enum.IntEnum):
    """Types of GGUF metadata values (gguf.h `enum gguf_type`): id and, for scalars, size."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12

    @property
    def struct_format(self) -> str:
        """The struct/numpy little-endian code of a scalar of this type ('' for STRING/ARRAY)."""
        return _FORMATS[self]


_FORMATS = {
    ValueType.UINT8: "<B", ValueType.INT8: "<b", ValueType.UINT16: "<H", ValueType.INT16: "<h",
    ValueType.UINT32: "<I", ValueType.INT32: "<i", ValueType.FLOAT32: "<f", ValueType.BOOL: "<?",
    ValueType.STRING: "", ValueType.ARRAY: "", ValueType.UINT64: "<Q", ValueType.INT64: "<q",
    ValueType.FLOAT64: "<d",
}  # fmt: skip


# llama-quantize's tensor_type_fallback (llama-quant.cpp): the type a tensor gets when its rows
# are not whole blocks of the one asked for; F16 when the fallback does not fit either.
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
             "TQ1_0": "Q4_0", "TQ2_0": "Q4_0", "Q2_0": "Q4_0", "IQ1_S": "IQ4_NL",
             "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL",
             "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL"}  # fmt: skip


def fallback_type(target: str | int | GGMLType, row_length: int) -> GGMLType:
    """The type llama-quantize writes for rows of `row_length` asked to be `target`: the target
    when rows are whole blocks, else its fallback (Q4_K -> Q5_0, Q6_K -> Q8_0, ...), else F16.
    KeyError for a 256-block type llama.cpp defines no fallback for (Q8_K)."""
    t = ggml_type(target)
    if row_length % t.block_size == 0:
        return t
    if t.block_size <= 32:
        return GGML_TYPES["F16"]
    if t.name not in _FALLBACK:
        raise KeyError(f"llama.cpp defines no fallback for {t.name}")
    fallback = GGML_TYPES[_FALLBACK[t.name]]
    return fallback if row_length % fallback.block_size == 0 else GGML_TYPES["F16"]
