"""The one table of tensor dtypes: safetensors names, their sizes, and the torch names.

Torch-free, so headers can be planned and inspected without importing torch. The order is the
reference writer's Dtype enum in declaration order (safetensors sorts tensors by it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dtype:
    """One safetensors dtype: its size and the torch dtype of the same bits (None: no torch)."""

    bits: int
    torch_name: str | None
    kind: str  # "float", "int", "bool", "complex" or "low-float" (fp8/fp6/fp4)


DTYPES: dict[str, Dtype] = {
    "BOOL": Dtype(8, "bool", "bool"),
    "F4": Dtype(4, None, "low-float"),
    "F6_E2M3": Dtype(6, None, "low-float"),
    "F6_E3M2": Dtype(6, None, "low-float"),
    "U8": Dtype(8, "uint8", "int"),
    "I8": Dtype(8, "int8", "int"),
    "F8_E5M2": Dtype(8, "float8_e5m2", "low-float"),
    "F8_E4M3": Dtype(8, "float8_e4m3fn", "low-float"),
    "F8_E8M0": Dtype(8, None, "low-float"),
    "I16": Dtype(16, "int16", "int"),
    "U16": Dtype(16, "uint16", "int"),
    "F16": Dtype(16, "float16", "float"),
    "BF16": Dtype(16, "bfloat16", "float"),
    "I32": Dtype(32, "int32", "int"),
    "U32": Dtype(32, "uint32", "int"),
    "F32": Dtype(32, "float32", "float"),
    "C64": Dtype(64, "complex64", "complex"),
    "F64": Dtype(64, "float64", "float"),
    "I64": Dtype(64, "int64", "int"),
    "U64": Dtype(64, "uint64", "int"),
}
DTYPE_BITS = {name: d.bits for name, d in DTYPES.items()}
FLOAT_DTYPES = tuple(name for name, d in DTYPES.items() if d.kind == "float")
RESTORE_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
"""dequantize --to choices and the safetensors dtype each writes."""


def non_float_reason(dtype: str) -> str:
    """Why a tensor of a non-float dtype is kept, in the one wording every output format's table
    gives: 'integer tensor', 'bool tensor', 'already low-precision (F8_E4M3)'."""
    if dtype == "BOOL":
        return "bool tensor"
    if dtype.startswith(("I", "U")):
        return "integer tensor"
    if dtype.startswith(("F8", "F4", "F6")):
        return f"already low-precision ({dtype})"
    return f"not a real float tensor ({dtype})"
