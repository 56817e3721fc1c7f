"""A deliberately plain reference of the semantics (numpy float32, one group at a time).

Independent of qtool.numerics.kernels: no torch, no blocking, no in-place tricks. Tests compare
qtool's codes and qparams with it bit for bit.
"""

from __future__ import annotations

import numpy as np

QRANGE = {
    ("sym", "int8"): (-127, 127),
    ("sym", "uint8"): (1, 255),
    ("asym", "int8"): (-128, 127),
    ("asym", "uint8"): (0, 255),
}
TINY = np.finfo(np.float32).tiny


def qparams(group: np.ndarray, scheme: str, dtype: str) -> tuple[np.float32, int]:
    """scale (float32) and zero point of one group, exactly as README 'Numerical semantics'."""
    qmin, qmax = QRANGE[scheme, dtype]
    lo = min(np.float32(group.min()), np.float32(0))
    hi = max(np.float32(group.max()), np.float32(0))
    if scheme == "sym":
        span = max(-lo, hi)
        scale = np.float32(span) / np.float32(127)
    else:
        span = np.float32(hi - lo)
        scale = np.float32(span) / np.float32(255)
    scale = np.float32(1.0) if span == 0 else max(np.float32(scale), TINY)
    if scheme == "sym":
        zero_point = 0 if dtype == "int8" else 128
    else:
        zero_point = int(np.clip(qmin - np.round(np.float32(lo) / scale), qmin, qmax))
    return np.float32(scale), zero_point


def quantize(
    x: np.ndarray, scheme: str, dtype: str, axis: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scales, zero points); scales/zero points have shape (C,) or ()."""
    x = np.asarray(x, dtype=np.float32)
    qmin, qmax = QRANGE[scheme, dtype]
    moved = x.reshape(1, -1) if axis is None else np.moveaxis(x, axis, 0)
    groups = moved.reshape(moved.shape[0], -1)
    codes = np.empty(groups.shape, dtype=np.int64)
    scales = np.empty(groups.shape[0], dtype=np.float32)
    zps = np.empty(groups.shape[0], dtype=np.int64)
    for c, g in enumerate(groups):
        scale, zp = qparams(g, scheme, dtype)
        scales[c], zps[c] = scale, zp
        codes[c] = np.clip(np.round(g / scale) + zp, qmin, qmax)  # float32 division, RNE
    codes = codes.reshape(moved.shape)
    codes = codes.reshape(x.shape) if axis is None else np.moveaxis(codes, 0, axis)
    np_dtype = np.int8 if dtype == "int8" else np.uint8
    if axis is None:
        return codes.astype(np_dtype), scales.reshape(()), zps.reshape(()).astype(np_dtype)
    return codes.astype(np_dtype), scales, zps.astype(np_dtype)


def dequantize(q: np.ndarray, scale: np.ndarray, zp: np.ndarray, axis: int | None) -> np.ndarray:
    shape = [1] * q.ndim
    if axis is not None:
        shape[axis] = -1
    s = np.asarray(scale, dtype=np.float32).reshape(shape)
    z = np.asarray(zp, dtype=np.float32).reshape(shape)
    return (q.astype(np.float32) - z) * s
