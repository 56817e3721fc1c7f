"""The vocabulary: schemes, storage dtypes, integer ranges and the quantization spec.

Pure Python (no torch), so the CLI can start and `inspect` can answer without importing torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

SEMANTICS = "qtool"
"""Name of the numerical convention below; recorded in every sidecar."""

RANGE_METHOD = "minmax"
"""How each group's range is found: its min and max (with 0.0 included); the only method so far."""


class Scheme(str, enum.Enum):
    """How the float range of a group maps onto the integer range.

    sym:  [-amax, amax] -> [qmin, qmax] with zero_point in the middle.
          int8, x = [-1.0, 0.3, 2.0]: scale = 2/127, zero_point = 0, q = [-64, 19, 127]
    asym: [min(x, 0), max(x, 0)] -> [qmin, qmax] (affine).
          uint8, same x: scale = 3/255, zero_point = 85, q = [0, 111, 255]
    """

    SYM = "sym"
    ASYM = "asym"


class StorageDtype(str, enum.Enum):
    """Integer type the codes are stored in."""

    INT8 = "int8"
    UINT8 = "uint8"

    @property
    def safetensors_dtype(self) -> str:
        return "I8" if self is StorageDtype.INT8 else "U8"

    @property
    def bits(self) -> int:
        return 8


# Symmetric ranges are mirrored around zero_point, so -x is exactly as representable as x.
_QRANGE: dict[tuple[Scheme, StorageDtype], tuple[int, int]] = {
    (Scheme.SYM, StorageDtype.INT8): (-127, 127),
    (Scheme.SYM, StorageDtype.UINT8): (1, 255),
    (Scheme.ASYM, StorageDtype.INT8): (-128, 127),
    (Scheme.ASYM, StorageDtype.UINT8): (0, 255),
}

_SYM_ZERO_POINT = {StorageDtype.INT8: 0, StorageDtype.UINT8: 128}


@dataclass(frozen=True)
class QSpec:
    """One quantization recipe: scheme, storage dtype and granularity.

    axis None quantizes per tensor; an int quantizes per channel along that axis (negative
    axes count from the end, as in torch).
    """

    scheme: Scheme = Scheme.SYM
    dtype: StorageDtype = StorageDtype.INT8
    axis: int | None = 0

    @property
    def qmin(self) -> int:
        return _QRANGE[self.scheme, self.dtype][0]

    @property
    def qmax(self) -> int:
        return _QRANGE[self.scheme, self.dtype][1]

    @property
    def symmetric_zero_point(self) -> int:
        """Zero point of every group under the symmetric scheme."""
        return _SYM_ZERO_POINT[self.dtype]

    @property
    def granularity(self) -> str:
        return "per-tensor" if self.axis is None else "per-channel"

    def describe(self) -> str:
        """Short label for tables: 'sym int8 axis 0' (per channel) or 'asym uint8 tensor'."""
        where = "tensor" if self.axis is None else f"axis {self.axis}"
        return f"{self.scheme.value} {self.dtype.value} {where}"
