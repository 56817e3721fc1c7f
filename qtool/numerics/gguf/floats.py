"""F32, F16 and BF16 as ggml stores them: (n, 1) float32 <-> (n, bytes) little-endian uint8."""

from __future__ import annotations

import torch


def quantize_f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.uint8)


def dequantize_f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def quantize_f16(blocks: torch.Tensor) -> torch.Tensor:
    """Round to nearest even, overflow to Inf (numpy's astype(float16), GGML_FP32_TO_FP16)."""
    return blocks.to(torch.float16).view(torch.uint8)


def dequantize_f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).to(torch.float32)


def quantize_bf16(blocks: torch.Tensor) -> torch.Tensor:
    """ggml_compute_fp32_to_bf16: NaN made quiet keeping its sign, else round to nearest even
    on the bits (torch's own cast turns every NaN into +NaN)."""
    n = blocks.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    n = torch.where(nan, (n & 0xFFFF0000) | (64 << 16), n)
    n = (n + (0x7FFF + ((n >> 16) & 1))) >> 16
    return _low16(n)


def _low16(n: torch.Tensor) -> torch.Tensor:
    """(n, 2) little-endian bytes of the low 16 bits of int64 n (n, 1)."""
    lo = (n & 0xFF).to(torch.uint8)
    hi = ((n >> 8) & 0xFF).to(torch.uint8)
    return torch.cat([lo, hi], -1)


def dequantize_bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).to(torch.float32)
