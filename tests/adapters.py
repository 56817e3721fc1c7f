"""The numeric tests' vocabulary (an IntRange, a granularity, a range method) mapped onto the
one kernel, qtool.numerics.kernels: codes come back unpacked, one per byte, in x's shape."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.numerics import kernels
from qtool.numerics.ranges import IntRange
from qtool.numerics.views import row_group_length
from qtool.spec import Granularity, PerGroup, QSpec, RangeMethod, Scheme, StorageDtype

DEFAULT_BLOCK_ELEMS = kernels.DEFAULT_BLOCK_ELEMS
SPECS = {(s.value, d.value): QSpec(s, d) for s in Scheme for d in StorageDtype}
INT_RANGES = {key: IntRange.of(spec) for key, spec in SPECS.items()}


def int_range(scheme: str, dtype: str) -> IntRange:
    if (scheme, dtype) not in INT_RANGES:
        raise ValueError(f"unknown scheme/dtype {scheme}/{dtype}")
    return INT_RANGES[scheme, dtype]


def spec_of(r: IntRange, granularity: Granularity, method: RangeMethod) -> QSpec:
    key = next(k for k, v in INT_RANGES.items() if v == r)
    return QSpec(Scheme(key[0]), StorageDtype(key[1]), granularity, method)


@dataclass(frozen=True)
class Quantized:
    q: torch.Tensor  # unpacked codes, x's shape
    scale: torch.Tensor
    zero_point: torch.Tensor
    choice: torch.Tensor | None


def quantize(
    x: torch.Tensor,
    granularity: Granularity,
    r: IntRange,
    method: RangeMethod = RangeMethod.MINMAX,
    *,
    scale_dtype: torch.dtype = torch.float32,
    block_elems: int = DEFAULT_BLOCK_ELEMS,
) -> Quantized:
    spec = spec_of(r, granularity, method)
    got = kernels.quantize_tensor(x, spec, scale_dtype=scale_dtype, block_elems=block_elems)
    return Quantized(_codes(got.q, spec, x), got.scale, got.zero_point, got.choice)


def quantize_with(
    x: torch.Tensor, granularity: Granularity, scale: torch.Tensor, zp: torch.Tensor, r: IntRange
) -> torch.Tensor:
    spec = spec_of(r, granularity, RangeMethod.MINMAX)
    return _codes(kernels.quantize(x, scale, zp, spec), spec, x)


def dequantize(
    q: torch.Tensor, granularity: Granularity, scale: torch.Tensor, zp: torch.Tensor
) -> torch.Tensor:
    # Unpacked codes dequantize the same whatever the bit width: pass them as 8-bit codes.
    dtype = StorageDtype.INT8 if q.dtype == torch.int8 else StorageDtype.UINT8
    return kernels.dequantize(q, scale, zp, QSpec(Scheme.ASYM, dtype, granularity))


def per_group_candidates(granularity: Granularity, shape: tuple[int, ...]) -> bool:
    """Whether the mse search uses the group candidate list (groups shorter than a row)."""
    return (
        isinstance(granularity, PerGroup)
        and row_group_length(QSpec(granularity=granularity), shape)
        != kernels.matrix_shape(shape)[1]
    )


def _codes(stored: torch.Tensor, spec: QSpec, x: torch.Tensor) -> torch.Tensor:
    if not spec.dtype.packed:
        return stored
    from qtool.numerics.packing import unpack_nibbles

    n = x.shape[-1] if x.ndim else 1
    return unpack_nibbles(stored, n, spec.dtype.signed).reshape(x.shape)
