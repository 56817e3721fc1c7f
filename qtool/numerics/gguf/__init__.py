"""GGUF (llama.cpp) tensor types: float rows <-> raw ggml blocks, any device.

    quantize(x, "Q4_K")        float (..., n) -> uint8 (..., n // 256 * 144)
    dequantize(raw, "Q4_K")    uint8 (..., n // 256 * 144) -> float32 (..., n)

Quantize gives the bytes of llama.cpp's reference quantizers on the same float32 input
(`llama-quantize` without an importance matrix), ggml's quantize_row_*_ref in an x86-64
release build: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (= gguf-py's `gguf.quants` but for the sign of a
zero scale or minimum, see legacy.py), Q2_K, Q3_K, Q4_K, Q5_K, Q6_K. Given quant_weights (one
importance value per column: imatrix.quant_weights, `llama-quantize --imatrix`) it gives the
bytes of ggml's quantize_<type>(..., quant_weights), the *_impl quantizers: other algorithms
than the reference ones (weighted.py, q23k.py, q6k.py); Q8_0 and the float types ignore the
weights, as ggml does. That build does not contract a*b+c
into FMAs; one that does (-march=native, most ARM builds) gives other bytes in up to a quarter
of K-quant rows (scripts/gguf_golden.py --fma-study). Dequantize gives the floats of
gguf.quants.dequantize for every type here. Input of any float dtype is converted to float32
first, as ggml does. No I/O.

Two implementations give the same bytes: the torch kernels (q45k.py, q6k.py, legacy.py,
dequant_k.py: any device, vectorised over blocks) and, on CPU, the fused numba kernels
(jit*.py: the C transcribed, sub-blocks side by side in vectors), chosen by fast.py as
QTOOL_KERNEL says. On blocks holding NaN or Inf only the fused kernels follow C's scans (the
torch reductions propagate NaN); qtool refuses non-finite weights before quantizing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from qtool.gguf_types import GGMLType, ggml_type
from qtool.numerics.gguf import dequant_k, fast, floats, legacy, weighted
from qtool.numerics.gguf.q6k import quantize_q6_k
from qtool.numerics.gguf.q23k import quantize_q2_k, quantize_q3_k
from qtool.numerics.gguf.q45k import quantize_q4_k, quantize_q5_k
from qtool.numerics.gguf.qfit import mean_square
from qtool.numerics.select import Kernel

Blocks = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Codec:
    """Block maths of one type: (n, block_size) float32 <-> (n, type_size) uint8; `chunk` is
    how many blocks one call takes at most on CPU (K-quants: their (32, S) temporaries stay
    in L2; larger chunks measured slower)."""

    quantize: Blocks | None
    dequantize: Blocks
    chunk: int


CODECS: dict[str, Codec] = {
    "F32": Codec(floats.quantize_f32, floats.dequantize_f32, 1 << 22),
    "F16": Codec(floats.quantize_f16, floats.dequantize_f16, 1 << 22),
    "BF16": Codec(floats.quantize_bf16, floats.dequantize_bf16, 1 << 22),
    "Q8_0": Codec(legacy.quantize_q8_0, legacy.dequantize_q8_0, 1 << 16),
    "Q4_0": Codec(legacy.quantize_q4_0, legacy.dequantize_q4_0, 1 << 16),
    "Q4_1": Codec(legacy.quantize_q4_1, legacy.dequantize_q4_1, 1 << 16),
    "Q5_0": Codec(legacy.quantize_q5_0, legacy.dequantize_q5_0, 1 << 16),
    "Q5_1": Codec(legacy.quantize_q5_1, legacy.dequantize_q5_1, 1 << 16),
    "Q2_K": Codec(quantize_q2_k, dequant_k.dequantize_q2_k, 1 << 9),
    "Q3_K": Codec(quantize_q3_k, dequant_k.dequantize_q3_k, 1 << 9),
    "Q4_K": Codec(quantize_q4_k, dequant_k.dequantize_q4_k, 1 << 9),
    "Q5_K": Codec(quantize_q5_k, dequant_k.dequantize_q5_k, 1 << 9),
    "Q6_K": Codec(quantize_q6_k, dequant_k.dequantize_q6_k, 1 << 9),
}
QUANTIZE_TYPES = tuple(name for name, c in CODECS.items() if c.quantize is not None)
DEQUANTIZE_TYPES = tuple(CODECS)

Weighted = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # blocks, quant_weights
WeightedRow = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # + sigma2
# ggml's quantize_<type> with quant_weights, and blocks per CPU call (make_qkx3_quants' 37
# grids over (32, S) temporaries, as the K-quants' chunks)
WEIGHTED: dict[str, tuple[Weighted, int]] = {
    "Q2_K": (quantize_q2_k, 1 << 8),
    "Q3_K": (quantize_q3_k, 1 << 8),
    "Q4_K": (weighted.quantize_q4_k, 1 << 8),
    "Q5_K": (weighted.quantize_q5_k, 1 << 8),
    "Q6_K": (quantize_q6_k, 1 << 9),
}
# the legacy ones weigh by the mean square of the whole row (sigma2)
WEIGHTED_ROW: dict[str, tuple[WeightedRow, int]] = {
    "Q4_0": (weighted.quantize_q4_0, 1 << 12),
    "Q4_1": (weighted.quantize_q4_1, 1 << 11),
    "Q5_0": (weighted.quantize_q5_0, 1 << 12),
    "Q5_1": (weighted.quantize_q5_1, 1 << 11),
}
UNWEIGHTED = ("F32", "F16", "BF16", "Q8_0")  # ggml ignores quant_weights for these


def quantize(
    x: torch.Tensor,
    qtype: str | GGMLType,
    *,
    kernel: Kernel | None = None,
    quant_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Raw ggml blocks of float rows x (..., n), n a multiple of the block size: uint8
    (..., n // block_size * type_size) on x's device (ValueError for misuse). `kernel`
    overrides QTOOL_KERNEL's choice between the torch and the fused kernels (same bytes).
    `quant_weights`: float (n,), finite and >= 0, the importance of each column for every row
    (imatrix.quant_weights); ggml's quantizers with an importance matrix."""
    t = ggml_type(qtype)
    codec = CODECS.get(t.name)
    if codec is None or codec.quantize is None:
        raise ValueError(
            f"qtool cannot quantize to {t.name}; it can to {', '.join(QUANTIZE_TYPES)}"
        )
    if not x.is_floating_point():
        raise ValueError(f"quantize to {t.name} takes a float tensor, not {x.dtype}")
    if x.ndim == 0 or x.shape[-1] % t.block_size:
        raise ValueError(f"{t.name}: rows of {tuple(x.shape)} are not multiples of {t.block_size}")
    if quant_weights is not None and t.name not in UNWEIGHTED:
        return _weighted(x, t, _checked_weights(quant_weights, x, t.name), kernel)
    blocks = x.reshape(-1, t.block_size).to(torch.float32)  # (n_blocks, block_size)
    if fast.chosen(t.name, blocks.device, blocks.numel(), True, kernel):
        out = fast.quantize(blocks, t.name, t.type_size)
    else:
        out = _chunked(codec.quantize, blocks, codec.chunk, torch.uint8, t.type_size)
    return out.view(*x.shape[:-1], x.shape[-1] // t.block_size * t.type_size)


def dequantize(
    raw: torch.Tensor, qtype: str | GGMLType, *, kernel: Kernel | None = None
) -> torch.Tensor:
    """float32 rows (..., n) of raw ggml blocks (..., row_bytes), row_bytes a multiple of the
    type's block bytes, on raw's device (ValueError for misuse); `kernel` as for quantize."""
    t = ggml_type(qtype)
    codec = CODECS.get(t.name)
    if codec is None:
        raise ValueError(f"qtool cannot dequantize {t.name}; it can {', '.join(DEQUANTIZE_TYPES)}")
    if raw.dtype != torch.uint8 or raw.ndim == 0 or raw.shape[-1] % t.type_size:
        raise ValueError(f"{t.name}: raw blocks must be uint8 rows of {t.type_size}-byte blocks")
    blocks = raw.reshape(-1, t.type_size)  # (n_blocks, type_size)
    n_floats = blocks.shape[0] * t.block_size
    if fast.chosen(t.name, blocks.device, n_floats, False, kernel):
        out = fast.dequantize(blocks, t.name, t.block_size)
    else:
        out = _chunked(codec.dequantize, blocks, codec.chunk, torch.float32, t.block_size)
    return out.view(*raw.shape[:-1], raw.shape[-1] // t.type_size * t.block_size)


def _checked_weights(qw: torch.Tensor, x: torch.Tensor, name: str) -> torch.Tensor:
    """quant_weights as float32 on x's device; ValueError unless (n,), finite and >= 0."""
    if not isinstance(qw, torch.Tensor) or qw.shape != (x.shape[-1],):
        shape = tuple(qw.shape) if isinstance(qw, torch.Tensor) else type(qw).__name__
        raise ValueError(f"{name}: quant_weights must be ({x.shape[-1]},), not {shape}")
    qw = qw.detach().to(device=x.device, dtype=torch.float32)
    if not bool((torch.isfinite(qw) & (qw >= 0)).all()):
        raise ValueError(f"{name}: quant_weights must be finite and not negative")
    return qw


def _weighted(
    x: torch.Tensor, t: GGMLType, qw: torch.Tensor, kernel: Kernel | None
) -> torch.Tensor:
    """quantize() with quant_weights: the rows in runs of whole rows (legacy types need each
    row's mean square), every block given its columns' weights."""
    n = x.shape[-1]
    rows = x.reshape(-1, n).to(torch.float32)
    per_row = n // t.block_size
    if fast.chosen_weighted(t.name, rows.device, rows.numel(), kernel):
        out = fast.quantize_weighted(rows, qw, t.name, per_row * t.type_size)
        return out.view(*x.shape[:-1], per_row * t.type_size)
    out = torch.empty(rows.shape[0], per_row * t.type_size, dtype=torch.uint8, device=x.device)
    legacy_fn, chunk = WEIGHTED_ROW.get(t.name, (None, 0))
    k_fn, chunk = WEIGHTED.get(t.name, (None, chunk))
    cpu = rows.device.type == "cpu"
    step = max(1, (chunk if cpu else chunk * 64) // per_row)
    qw_blocks = qw.view(per_row, t.block_size)
    with _one_thread(cpu):
        for start in range(0, rows.shape[0], step):
            part = rows[start : start + step]
            blocks = part.reshape(-1, t.block_size)
            w = qw_blocks.repeat(part.shape[0], 1)
            if legacy_fn is not None:
                sigma2 = mean_square(part, 1.0).repeat_interleave(per_row)
                q = legacy_fn(blocks, w, sigma2)
            else:
                assert k_fn is not None
                q = k_fn(blocks, w)
            out[start : start + step] = q.view(part.shape[0], -1)
    return out.view(*x.shape[:-1], per_row * t.type_size)


def _chunked(
    fn: Blocks, blocks: torch.Tensor, chunk: int, dtype: torch.dtype, width: int
) -> torch.Tensor:
    """fn over blocks in runs of at most `chunk` blocks (64x more off the CPU, where kernel
    launches, not caches, bound the time), into one (n_blocks, width) tensor."""
    n = blocks.shape[0]
    cpu = blocks.device.type == "cpu"
    chunk = chunk if cpu else chunk * 64
    with _one_thread(cpu):
        if n <= chunk:
            return fn(blocks)
        out = torch.empty(n, width, dtype=dtype, device=blocks.device)
        for start in range(0, n, chunk):
            out[start : start + chunk] = fn(blocks[start : start + chunk])
    return out


@contextlib.contextmanager
def _one_thread(cpu: bool) -> Iterator[None]:
    """torch on one thread while the torch kernels run on CPU: their ops are small (a chunk
    stays in L2), and torch's thread pool syncing after each one made the K-quants 50x slower
    on 2 busy cores (0.09 vs 4.3 MB/s, scripts/bench_gguf.py)."""
    before = torch.get_num_threads()
    if not cpu or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
