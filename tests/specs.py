"""Building specs in tests the way the first product named them: by channel axis."""

from __future__ import annotations

from qtool.spec import PerChannel, PerTensor, QSpec, Scheme, StorageDtype


def qspec(
    scheme: Scheme = Scheme.SYM, dtype: StorageDtype = StorageDtype.INT8, axis: int | None = 0
) -> QSpec:
    """Per channel along `axis`, or per tensor for None."""
    return QSpec(scheme, dtype, PerTensor() if axis is None else PerChannel(axis))
