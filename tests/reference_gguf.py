"""A scalar transcription of ggml's K-quant reference (ggml-quants.c), one float32 operation per
C operation in C order: an oracle independent of qtool's vectorised kernels, checked against the
C goldens, then used by hypothesis where no golden exists. Slow (pure Python): a few blocks only.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

f32 = np.float32
EPS = f32(1e-15)


def nearest_int(v: np.float32) -> int:
    bits = int(np.array(f32(v + f32(12582912.0)), dtype=np.float32).view(np.int32))
    return 0 if np.isnan(v) else (bits & 0x007FFFFF) - 0x00400000


def fp16(v: np.float32) -> np.float32:
    return f32(np.float16(v))


def make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple:
    lo, hi, sum_w, sum_x = x[0], x[0], w[0], f32(w[0] * x[0])
    for i in range(1, len(x)):
        lo, hi = min(lo, x[i]), max(hi, x[i])
        sum_w, sum_x = f32(sum_w + w[i]), f32(sum_x + f32(w[i] * x[i]))
    lo = f32(0) if lo > 0 else lo
    if hi == lo:
        return f32(0), f32(-lo), [0] * len(x)
    iscale = f32(f32(nmax) / f32(hi - lo))
    scale = f32(f32(1) / iscale)
    L = [max(0, min(nmax, nearest_int(f32(iscale * f32(v - lo))))) for v in x]
    best = _error(x, w, L, scale, lo)
    for step in range(nstep + 1):
        numer = f32(f32(f32(rmin) + f32(f32(0.1) * f32(step))) + f32(nmax))
        iscale = f32(numer / f32(hi - lo))
        La = [max(0, min(nmax, nearest_int(f32(iscale * f32(v - lo))))) for v in x]
        sl = sl2 = sxl = f32(0)
        for v, wi, li in zip(x, w, La, strict=True):
            wl = f32(wi * f32(li))
            sl, sl2, sxl = f32(sl + wl), f32(sl2 + f32(wl * f32(li))), f32(sxl + f32(wl * v))
        D = f32(f32(sum_w * sl2) - f32(sl * sl))
        if D > 0:
            ts = f32(f32(f32(sum_w * sxl) - f32(sum_x * sl)) / D)
            tm = f32(f32(f32(sl2 * sum_x) - f32(sl * sxl)) / D)
            if tm > 0:
                tm, ts = f32(0), f32(sxl / sl2)
            cur = _error(x, w, La, ts, tm)
            if cur < best:
                L, best, scale, lo = La, cur, ts, tm
    return scale, f32(-lo), L


def _error(x: np.ndarray, w: np.ndarray, L: list[int], scale: np.float32, lo: np.float32) -> f32:
    err = f32(0)
    for v, wi, li in zip(x, w, L, strict=True):
        diff = f32(f32(f32(scale * f32(li)) + lo) - v)
        err = f32(err + f32(wi * f32(diff * diff)))
    return err


def quantize_q45_k(block: np.ndarray, nmax: int) -> tuple[np.float32, np.float32, list, list]:
    """(d, dmin, [(ls, lm)] * 8, codes[256]) of quantize_row_q4_K_ref (nmax 15) / q5_K (31)."""
    rmin, nstep = (-1.0, 20) if nmax == 15 else (-0.5, 15)
    fits, L = [], []
    for j in range(8):
        x = block[32 * j : 32 * j + 32]
        sx2 = f32(0)
        for v in x:
            sx2 = f32(sx2 + f32(v * v))
        av = f32(np.sqrt(f32(sx2 / f32(32))))
        w = np.array([f32(av + abs(v)) for v in x], dtype=np.float32)
        scale, the_min, codes = make_qkx2(x, w, nmax, rmin, nstep)
        fits.append((scale, the_min))
        L += codes
    max_scale = max([f32(0)] + [s for s, _ in fits])
    max_min = max([f32(0)] + [m for _, m in fits])
    inv_s = f32(f32(63) / max_scale) if max_scale > 0 else f32(0)
    inv_m = f32(f32(63) / max_min) if max_min > 0 else f32(0)
    six = [
        (min(63, nearest_int(f32(inv_s * s)) & 0xFF), min(63, nearest_int(f32(inv_m * m)) & 0xFF))
        for s, m in fits
    ]
    d, dmin = fp16(f32(max_scale / f32(63))), fp16(f32(max_min / f32(63)))
    for j, (ls, lm) in enumerate(six):
        step = f32(d * f32(ls))
        if step:
            off = f32(dmin * f32(lm))
            for i in range(32 * j, 32 * j + 32):
                L[i] = max(0, min(nmax, nearest_int(f32(f32(block[i] + off) / step))))
    return d, dmin, six, L


def make_qx(x: np.ndarray, nmax: int = 32) -> tuple[np.float32, list[int]]:
    amax, top = f32(0), f32(0)
    for v in x:
        if abs(v) > amax:
            amax, top = abs(v), v
    if amax < EPS:
        return f32(0), [0] * len(x)

    def sums(iscale: np.float32) -> tuple[np.float32, np.float32, list[int]]:
        lx = l2 = f32(0)
        codes = []
        for v in x:
            li = max(-nmax, min(nmax - 1, nearest_int(f32(iscale * v))))
            codes.append(li + nmax)
            wv = f32(v * v)
            lx, l2 = f32(lx + f32(f32(wv * v) * f32(li))), f32(l2 + f32(f32(wv * f32(li)) * li))
        return lx, l2, codes

    lx, l2, L = sums(f32(f32(-nmax) / top))
    scale = f32(lx / l2) if l2 else f32(0)
    best = f32(scale * lx)
    for step in [s for s in range(-9, 10) if s]:
        lx, l2, codes = sums(f32(f32(-f32(f32(nmax) + f32(f32(0.1) * f32(step)))) / top))
        if l2 > 0 and f32(lx * lx) > f32(best * l2):
            L, scale = codes, f32(lx / l2)
            best = f32(scale * lx)
    return scale, L


def quantize_q6_k(block: np.ndarray) -> tuple[np.float32, list[int], list[int]] | None:
    """(d, int8 scales[16], codes[256]) of quantize_row_q6_K_ref; None for an all-zero block."""
    fits = [make_qx(block[16 * j : 16 * j + 16]) for j in range(16)]
    top_abs, top = f32(0), f32(0)
    for s, _ in fits:
        if abs(s) > top_abs:
            top_abs, top = abs(s), s
    if top_abs < EPS:
        return None
    iscale = f32(f32(-128) / top)
    d = fp16(f32(f32(1) / iscale))
    scales = [
        int(np.int8(np.uint8(min(127, nearest_int(f32(iscale * s))) & 0xFF))) for s, _ in fits
    ]
    L = [c for _, codes in fits for c in codes]
    for j, sc in enumerate(scales):
        step = f32(d * f32(sc))
        if step:
            for i in range(16 * j, 16 * j + 16):
                L[i] = max(-32, min(31, nearest_int(f32(block[i] / step)))) + 32
    return d, scales, L


def _scale_bytes(six: list[tuple[int, int]]) -> list[int]:
    out = [0] * 12
    for j, (ls, lm) in enumerate(six):
        if j < 4:
            out[j], out[j + 4] = ls, lm
        else:
            out[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            out[j - 4] |= (ls >> 4) << 6
            out[j] |= (lm >> 4) << 6
    return out


def q4_k_bytes(block: np.ndarray) -> bytes:
    d, dmin, six, L = quantize_q45_k(block, 15)
    qs = [L[j + i] | (L[j + i + 32] << 4) for j in range(0, 256, 64) for i in range(32)]
    return d.astype("<f2").tobytes() + dmin.astype("<f2").tobytes() + bytes(_scale_bytes(six) + qs)


def q5_k_bytes(block: np.ndarray) -> bytes:
    d, dmin, six, L = quantize_q45_k(block, 31)
    qh, ql = [0] * 32, []
    for c, n in enumerate(range(0, 256, 64)):
        for i in range(32):
            lo, hi = L[n + i], L[n + i + 32]
            qh[i] |= ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1))
            ql.append((lo & 0xF) | ((hi & 0xF) << 4))
    return (
        d.astype("<f2").tobytes()
        + dmin.astype("<f2").tobytes()
        + bytes(_scale_bytes(six) + qh + ql)
    )


def q6_k_bytes(block: np.ndarray) -> bytes:
    fit = quantize_q6_k(block)
    if fit is None:
        return bytes(210)
    d, scales, L = fit
    ql, qh = [0] * 128, [0] * 64
    for h in range(2):
        for i in range(32):
            q = [L[128 * h + 32 * k + i] for k in range(4)]
            ql[64 * h + i] = (q[0] & 0xF) | ((q[2] & 0xF) << 4)
            ql[64 * h + 32 + i] = (q[1] & 0xF) | ((q[3] & 0xF) << 4)
            qh[32 * h + i] = (q[0] >> 4) | (q[1] >> 4) << 2 | (q[2] >> 4) << 4 | (q[3] >> 4) << 6
    return bytes(ql + qh + [s & 0xFF for s in scales]) + d.astype("<f2").tobytes()


def _quiet(fn: Callable[[np.ndarray], bytes]) -> Callable[[np.ndarray], bytes]:
    """C overflows to Inf/NaN silently; numpy warns (an error under pytest)."""

    def run(block: np.ndarray) -> bytes:
        with np.errstate(all="ignore"):
            return fn(block)

    return run


REFERENCE = {"Q4_K": _quiet(q4_k_bytes), "Q5_K": _quiet(q5_k_bytes), "Q6_K": _quiet(q6_k_bytes)}
