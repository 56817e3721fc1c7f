"""One tensor quantized to a GGUF block type as the quantize loop and the error budget take it
(numerics/kernels.py dispatches a GGUFSpec here, through codec.py):

    quantize_tensor(x, gguf_spec("Q4_K"))  QuantizedTensor: q the raw ggml blocks of x's rows
                                           (uint8 (rows, row_bytes)), scale each block's scale
                                           d (float32 (rows, blocks)), errors measured on what
                                           ggml reconstructs from those bytes

Rows are x's last dimension (ggml's ne[0]) and must be whole blocks (spec.fit_spec gives
llama-quantize's fallback type where they are not). NaN/Inf is NonFiniteInput, as for qtool's
integer kernels: the tensor is an error or kept, never quantized. No I/O.
"""

from __future__ import annotations

import torch

from qtool.gguf_types import GGMLType
from qtool.numerics import gguf, metrics
from qtool.numerics.gguf import fast
from qtool.numerics.kernels import QuantizedTensor
from qtool.numerics.range_methods import GridOverflow
from qtool.numerics.ranges import NonFiniteInput
from qtool.spec import GGUFSpec


def quantize_tensor(
    x: torch.Tensor,
    spec: GGUFSpec,
    *,
    with_errors: bool = True,
    quant_weights: torch.Tensor | None = None,
) -> QuantizedTensor:
    """x's rows as `spec`'s GGUF blocks, with the error of their dequantization (ValueError for
    rows that are not whole blocks or a type qtool cannot quantize to). `quant_weights`: an
    importance matrix's weights (imatrix.quant_weights: (k,) or (n_mat, k), row e for the rows
    of matrix e of a 3-D weight of stacked experts), as llama-quantize --imatrix hands them to
    ggml's quantizers."""
    t = spec.gguf
    if x.ndim == 0 or x.shape[-1] % t.block_size:
        row = x.shape[-1] if x.ndim else 1
        raise ValueError(f"rows of {row} are not whole {t.name} blocks of {t.block_size}")
    _refuse_nonfinite(x)
    x32 = x.to(torch.float32).contiguous()
    codes = _codes(x32.reshape(-1, x.shape[-1]), t, quant_weights)
    if _overflowed(codes, t):
        raise _overflow(x32, t, quant_weights)
    errors = None
    if with_errors:
        x_hat = gguf.dequantize(codes, t).view(x.shape)
        errors = fast.error_stats(x32, x_hat) if x32.is_cpu else metrics.error_stats(x32, x_hat)
    empty = torch.zeros(0, dtype=torch.uint8, device=x.device)
    return QuantizedTensor(codes, block_scales(codes, t), empty, errors)


def _codes(rows: torch.Tensor, t: GGMLType, quant_weights: torch.Tensor | None) -> torch.Tensor:
    """The blocks of rows (r, k); with weights (n_mat, k), r / n_mat rows per matrix."""
    if quant_weights is None:
        return gguf.quantize(rows, t)
    k = rows.shape[-1]
    if quant_weights.numel() == 0 or quant_weights.numel() % k:
        raise ValueError(f"quant_weights of {tuple(quant_weights.shape)} are not rows of {k}")
    w = quant_weights.reshape(-1, k)
    if rows.shape[0] % w.shape[0]:
        raise ValueError(f"{rows.shape[0]} rows do not split into {w.shape[0]} matrices")
    per = rows.shape[0] // w.shape[0]
    parts = [gguf.quantize(rows[e * per : (e + 1) * per], t, quant_weights=w[e])
             for e in range(w.shape[0])]  # fmt: skip
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def block_scales(codes: torch.Tensor, t: GGMLType) -> torch.Tensor:
    """Each block's scale d (fp16 in the block: first, or at 80/108/208 for Q2_K/Q3_K/Q6_K) as
    float32, one row per row of `codes`; what a table's scale range shows of a GGUF tensor."""
    at = _HALVES.get(t.name, (0,))[0]
    blocks = codes.reshape(-1, t.type_size)[:, at : at + 2].contiguous()
    return blocks.view(torch.float16).to(torch.float32).reshape(codes.shape[0], -1)


# where ggml's block structs hold their fp16 scale d and min (m, dmin), by type
_HALVES = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
           "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
           "Q6_K": (208,)}  # fmt: skip
_FP16_MAX = 65504.0


class ScaleOverflow(GridOverflow):
    """A block's fp16 scale or min came out Inf/NaN from finite values: the file would hold
    blocks ggml (and qtool's reader) restore as Inf/NaN."""


class ImportanceOverflow(ScaleOverflow):
    """The scales overflow only with the importance matrix's weights (`source`: its file)."""

    def __init__(self, type_name: str, largest: float, source: str = "") -> None:
        self.type_name, self.largest = type_name, largest
        imatrix = f"the importance matrix {source}" if source else "the importance matrix"
        super().__init__(
            f"{imatrix}'s weights for it (largest {largest:.3g}) make its {type_name} blocks' "
            "fp16 scales overflow, which they do not without them (ggml does not rescale "
            "them); recompute the importance matrix, or keep this tensor as it is"
        )


def _overflowed(codes: torch.Tensor, t: GGMLType) -> bool:
    """Any block's fp16 d or min Inf/NaN: its exponent bits (0x7C of the high byte) all set.
    One byte per half per block, no dequantization."""
    blocks = codes.reshape(-1, t.type_size)
    return any(bool(((blocks[:, at + 1] & 0x7C) == 0x7C).any()) for at in _HALVES.get(t.name, ()))


def _overflow(x32: torch.Tensor, t: GGMLType, quant_weights: torch.Tensor | None) -> ScaleOverflow:
    """Why the scales overflowed: the importance matrix's weights (the blocks fit without them;
    ggml does not rescale them either), or values too large for any fp16 scale of `t`."""
    if quant_weights is not None and not _overflowed(
        _codes(x32.reshape(-1, x32.shape[-1]), t, None), t
    ):
        return ImportanceOverflow(t.name, float(quant_weights.max()))
    largest = float(x32.abs().max())
    q8 = _FP16_MAX * 127  # Q8_0's scale is largest / 127
    other = f", or give it Q8_0 (it holds magnitudes up to {q8:.3g})" if largest <= q8 else ""
    return ScaleOverflow(
        f"its largest magnitude {largest:.3g} overflows {t.name}'s fp16 block scales (at most "
        f"{_FP16_MAX:g}); keep this tensor as it is (F32){'' if t.name == 'Q8_0' else other}"
    )


def _refuse_nonfinite(x: torch.Tensor) -> None:
    """NonFiniteInput (counted) when x holds NaN/Inf: one aminmax pass (it propagates NaN),
    ~20x faster than isfinite on bf16; counted only when found."""
    if x.numel() == 0:
        return
    lo, hi = torch.aminmax(x.reshape(-1))
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        raise NonFiniteInput(metrics.count_nonfinite(x))
