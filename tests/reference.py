"""A deliberately plain reference of the semantics (numpy float32, one group at a time).

Independent of qtool.numerics.kernels: no torch, no blocking, no in-place tricks. Tests compare
qtool's codes and qparams with it bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

QRANGE = {
    ("sym", "int8"): (-127, 127),
    ("sym", "uint8"): (1, 255),
    ("asym", "int8"): (-128, 127),
    ("asym", "uint8"): (0, 255),
}
TINY = np.finfo(np.float32).tiny


def qparams(group: np.ndarray, scheme: str, dtype: str) -> tuple[np.float32, int]:
    """scale (float32) and zero point of one group, exactly as docs/numerics.md."""
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


# ---- docs/numerics.md: 4-bit ranges, groups, scale storage dtypes, the mse candidate search ----

QRANGE_V2 = {
    **QRANGE,
    ("sym", "int4"): (-8, 7),
    ("sym", "uint4"): (0, 15),
    ("asym", "int4"): (-8, 7),
    ("asym", "uint4"): (0, 15),
}
SYM_ZERO_POINT = {"int8": 0, "uint8": 128, "int4": 0, "uint4": 8}


def to_scale_dtype(scale: np.float32, scale_dtype: str) -> np.float32:
    """Round a float32 scale to its storage dtype (nearest, ties to even), never to 0 or Inf."""
    if scale_dtype == "float32":
        return np.float32(scale)
    if scale_dtype == "float16":
        low, high = np.float32(2.0**-24), np.float32(65504.0)
        return np.float32(np.float16(min(max(scale, low), high)))
    # bfloat16: keep the top 16 bits of the float32, rounding the dropped 16 to nearest-even.
    low, high = np.float32(2.0**-133), np.float32(3.3895313892515355e38)
    bits = int(np.array(min(max(scale, low), high), dtype=np.float32).view(np.uint32))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return np.float32(np.array(bits, dtype=np.uint32).view(np.float32))


def qparams_v2(
    group: np.ndarray, scheme: str, dtype: str, p: float = 1.0, scale_dtype: str = "float32"
) -> tuple[np.float32, int]:
    """scale and zero point of one group for the range (lo * p, hi * p): docs/numerics.md."""
    qmin, qmax = QRANGE_V2[scheme, dtype]
    lo = np.float32(min(np.float32(group.min()), np.float32(0)) * np.float32(p))
    hi = np.float32(max(np.float32(group.max()), np.float32(0)) * np.float32(p))
    if scheme == "sym":
        span = np.float32(max(-lo, hi))
        scale = span / np.float32((qmax - qmin) / 2)  # 127 at 8 bits, 7.5 at 4 bits
    else:
        span = np.float32(hi - lo)
        scale = span / np.float32(qmax - qmin)
    scale = np.float32(1.0) if span == 0 else max(np.float32(scale), TINY)
    scale = to_scale_dtype(np.float32(scale), scale_dtype)
    if scheme == "sym":
        return scale, SYM_ZERO_POINT[dtype]
    return scale, int(np.clip(qmin - np.round(lo / scale), qmin, qmax))


def code_group(g: np.ndarray, scale: np.float32, zp: int, qmin: int, qmax: int) -> np.ndarray:
    return np.clip(np.round(g / scale) + zp, qmin, qmax).astype(np.int64)  # f32 division, RNE


def group_sse(g: np.ndarray, codes: np.ndarray, scale: np.float32, zp: int) -> float:
    """Exact sum of squared float32 errors (math.fsum of exact float64 squares)."""
    err = (codes.astype(np.float32) - np.float32(zp)) * scale - g
    return math.fsum((err.astype(np.float64) ** 2).tolist())


def _best(
    g: np.ndarray, scheme: str, dtype: str, candidates: list[float], scale_dtype: str
) -> tuple[np.float32, int, int]:
    qmin, qmax = QRANGE_V2[scheme, dtype]
    best = None
    for k, p in enumerate(candidates):
        with np.errstate(over="ignore"):
            scale, zp = qparams_v2(g, scheme, dtype, p, scale_dtype)
        if not np.isfinite(scale):
            continue
        sse = group_sse(g, code_group(g, scale, zp, qmin, qmax), scale, zp)
        if best is None or sse < best[0]:  # strictly smaller: ties keep the earlier candidate
            best = (sse, scale, zp, k)
    assert best is not None
    return best[1], best[2], best[3]


def groups_of(x: np.ndarray, granularity: tuple[str, int]) -> tuple[list[list[np.ndarray]], Any]:
    """Index arrays of every group, as a [rows][cols] grid, and the qparam shape."""
    kind, arg = granularity
    idx = np.arange(x.size).reshape(x.shape)
    if kind == "tensor":
        return [[idx.reshape(-1)]], ()
    if kind == "channel":
        moved = np.moveaxis(idx, arg, 0)
        return [[row.reshape(-1)] for row in moved], (x.shape[arg],)
    rows = idx.reshape(x.shape[0], -1)
    grid = [[row[j : j + arg] for j in range(0, row.size, arg)] for row in rows]
    return grid, (rows.shape[0], len(grid[0]))


def quantize_v2(
    x: np.ndarray,
    scheme: str,
    dtype: str,
    granularity: tuple[str, int],
    method: str = "minmax",
    candidates: list[float] | None = None,
    scale_dtype: str = "float32",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(codes int64, scales float32, zero points int64, choices int64); granularity is
    ("tensor", 0), ("channel", axis) or ("group", G); qparams have the granularity's shape."""
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    qmin, qmax = QRANGE_V2[scheme, dtype]
    grid, shape = groups_of(np.asarray(x), granularity)
    codes = np.empty(flat.size, dtype=np.int64)
    scales, zps, choices = [], [], []
    for row in grid:
        for members in row:
            g = flat[members]
            if method == "minmax":
                scale, zp, k = *qparams_v2(g, scheme, dtype, 1.0, scale_dtype), 0
            else:
                scale, zp, k = _best(g, scheme, dtype, candidates or [1.0], scale_dtype)
            codes[members] = code_group(g, scale, zp, qmin, qmax)
            scales.append(scale)
            zps.append(zp)
            choices.append(k)

    def grid_array(values: list[Any], np_dtype: Any) -> np.ndarray:
        return np.array(values, dtype=np_dtype).reshape(shape)

    return (
        codes.reshape(np.shape(x)),
        grid_array(scales, np.float32),
        grid_array(zps, np.int64),
        grid_array(choices, np.int64),
    )


# ---- docs/numerics.md, "GPTQ": the textbook column loop (no blocks, no lazy updates) ----


def gptq_codes(
    weight: np.ndarray,
    hessian: np.ndarray,
    scheme: str,
    dtype: str,
    granularity: tuple[str, int],
    *,
    act_order: bool,
    damp: float = 0.01,
    dynamic_groups: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes int64 in original column order, scales, zero points) in float64 throughout:
    dead columns zeroed, min-max qparams of the (zeroed) weights, H + damp * mean(diag H) I
    inverted by numpy, its upper Cholesky factor U, then for each column t in order:
    q = round to the column's group, err = (w_t - x_hat_t) / U[t, t], W[:, t+1:] -= err U[t, t+1:].
    granularity ("channel", 0) or ("group", G); with `dynamic_groups` a group's qparams come from
    its columns' current values when the first of them is reached."""
    w = np.array(weight, dtype=np.float64)
    h = np.array(hessian, dtype=np.float64)
    k = w.shape[1]
    qmin, qmax = QRANGE_V2[scheme, dtype]
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    _, scales, zps, _ = quantize_v2(w.astype(np.float32), scheme, dtype, granularity)
    scales = scales.reshape(w.shape[0], -1).astype(np.float64)
    zps = zps.reshape(w.shape[0], -1).astype(np.float64)
    size = granularity[1] if granularity[0] == "group" else k
    h = h + np.eye(k) * damp * np.mean(np.diag(h))
    u = np.linalg.cholesky(np.linalg.inv(h[np.ix_(order, order)])).T
    w = w[:, order]
    codes = np.zeros(w.shape, dtype=np.int64)
    seen: set[int] = set()
    for t in range(k):
        c = int(order[t])
        g = c // size
        if dynamic_groups and size < k and g not in seen:
            members = [
                int(np.where(order == m)[0][0]) for m in range(g * size, min(g * size + size, k))
            ]
            for r in range(w.shape[0]):
                s, z = qparams_v2(w[r, members].astype(np.float32), scheme, dtype)
                scales[r, g], zps[r, g] = s, z
        seen.add(g)
        q = np.clip(np.round(w[:, t] / scales[:, g]) + zps[:, g], qmin, qmax)
        codes[:, c] = q
        err = (w[:, t] - (q - zps[:, g]) * scales[:, g]) / u[t, t]
        w[:, t + 1 :] -= np.outer(err, u[t, t + 1 :])
    return codes, scales.astype(np.float32), zps.astype(np.int64)


# ---- docs/numerics.md, "AWQ": llm-compressor's AWQModifier formulas, one element at a time ----


def awq_weight_means(weights: list[np.ndarray], granularity: tuple[str, int]) -> np.ndarray:
    """Mean over all rows of all weights of |w_rj| / (max |w| of (r, j)'s group + 1e-6)."""
    k = weights[0].shape[1]
    total = np.zeros(k, dtype=np.float64)
    rows = 0
    for w in weights:
        a = np.abs(np.asarray(w, dtype=np.float32))
        norm = np.empty_like(a)
        kind, size = granularity
        for r in range(a.shape[0]):
            for j in range(k):
                if kind == "tensor":
                    peak = a.max()
                elif kind == "channel":
                    peak = a[r].max()
                else:
                    g0 = j // size * size
                    peak = a[r, g0 : g0 + size].max()
                norm[r, j] = a[r, j] / (np.float32(peak) + np.float32(1e-6))
        total += norm.astype(np.float64).sum(axis=0)
        rows += a.shape[0]
    return (total / rows).astype(np.float32)


def awq_scales(x_mean: np.ndarray, w_mean: np.ndarray, alpha: float, duo: bool) -> np.ndarray:
    """s = clamp(x^a / (w^(1-a) + 1e-4), 1e-4) (duo) or clamp(x^a, 1e-4); s / sqrt(max s min s)."""
    x = np.asarray(x_mean, dtype=np.float64)
    s = x**alpha
    if duo:
        s = s / (np.asarray(w_mean, dtype=np.float64) ** (1 - alpha) + 1e-4)
    s = np.maximum(s, 1e-4)
    s = s / np.sqrt(s.max() * s.min())
    return np.where(np.isfinite(s), s, 1.0)
