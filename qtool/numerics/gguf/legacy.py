"""Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0: blocks of 32 with one fp16 scale (and minimum).

Quantize gives the bytes of ggml's quantize_row_*_ref (built without FMA contraction), which
are gguf-py's `gguf.quants` bytes except for the sign of a zero scale or minimum: C keeps the
first of +0.0/-0.0 it meets and starts Q4_0/Q5_0's signed maximum at +0.0, numpy's reductions
do not (same floats when dequantized; tests/numerics/test_gguf.py shows both). Dequantize gives
gguf.quants' floats. Each function maps (n_blocks, 32)
float32 to (n_blocks, type_size) uint8 or back.
"""

from __future__ import annotations

import torch

from qtool.numerics.gguf.cops import (
    c_roundf,
    c_trunc,
    div,
    fp16_bytes,
    low_byte,
    pack_nibbles,
    read_fp16,
)

_HALF = 16  # a block of 32 packs element j with element j + 16


def _signed_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 1) the first element of largest magnitude, with its sign, or +0.0 when all are
    zero (C: `float max = 0; if (amax < fabsf(v)) ...`; numpy takes a first -0.0)."""
    amax, first = blocks.abs().max(-1, keepdim=True)
    return torch.where(amax == 0, 0.0, blocks.gather(-1, first))


def _first_extremes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 1) min and max as C's `if (v < min) min = v` finds them: of +0.0 and -0.0 the one
    met first (torch's and numpy's reductions pick either; the sign lands in the file)."""
    out = []
    for extreme in (blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)):
        first = (blocks == extreme).to(torch.uint8).argmax(-1, keepdim=True)
        out.append(blocks.gather(-1, first))
    return out[0], out[1]


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1/d, or 0 where d is 0 (C: `d ? 1.0f/d : 0.0f`)."""
    return torch.where(d == 0, 0.0, div(1.0, d, d))


def _codes(v: torch.Tensor, qmax: int) -> torch.Tensor:
    """uint8 codes min(qmax, (uint8)(int)v), the cast as numpy/x86 performs it."""
    return low_byte(c_trunc(v)).clamp_(0, qmax)


def _qh(q: torch.Tensor) -> torch.Tensor:
    """(n, 4) uint8: bit j of a little-endian uint32 is bit 4 of code j (codes 0..31)."""
    bits = (q >> 4).to(torch.int32).view(-1, 4, 8)  # (n_blocks * 4, ...) bytes of 8 codes
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32, device=q.device)
    return (bits * weights).sum(-1).to(torch.uint8).view(q.shape[0], 4)


def quantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = div(_signed_absmax(blocks), -8.0, blocks)  # (n, 1)
    q = _codes(blocks * _inverse(d) + 8.5, 15)  # (n, 32)
    return torch.cat([fp16_bytes(d[:, 0]), pack_nibbles(q[:, :_HALF], q[:, _HALF:])], -1)


def quantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    lo, hi = _first_extremes(blocks)  # (n, 1)
    d = div(hi - lo, 15.0, blocks)
    q = _codes((blocks - lo) * _inverse(d) + 0.5, 15)
    packed = pack_nibbles(q[:, :_HALF], q[:, _HALF:])
    return torch.cat([fp16_bytes(d[:, 0]), fp16_bytes(lo[:, 0]), packed], -1)


def quantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = div(_signed_absmax(blocks), -16.0, blocks)
    q = _codes(blocks * _inverse(d) + 16.5, 31)
    packed = pack_nibbles(q[:, :_HALF], q[:, _HALF:])
    return torch.cat([fp16_bytes(d[:, 0]), _qh(q), packed], -1)


def quantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    lo, hi = _first_extremes(blocks)
    d = div(hi - lo, 31.0, blocks)
    q = _codes((blocks - lo) * _inverse(d) + 0.5, 31)
    packed = pack_nibbles(q[:, :_HALF], q[:, _HALF:])
    return torch.cat([fp16_bytes(d[:, 0]), fp16_bytes(lo[:, 0]), _qh(q), packed], -1)


def quantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = div(blocks.abs().amax(-1, keepdim=True), 127.0, blocks)
    q = low_byte(c_trunc(c_roundf(blocks * _inverse(d))))  # int8 codes as their bytes
    return torch.cat([fp16_bytes(d[:, 0]), q], -1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 32) codes from (n, 16) bytes: low nibbles are elements 0..15, high ones 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], -1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, 32) bit 4 of each code from the (n, 4) little-endian uint32 `qh`."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = read_fp16(blocks[:, 0:2]).unsqueeze(-1)
    return d * (_nibbles(blocks[:, 2:]).to(torch.float32) - 8.0)


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = read_fp16(blocks[:, 0:2]).unsqueeze(-1), read_fp16(blocks[:, 2:4]).unsqueeze(-1)
    return d * _nibbles(blocks[:, 4:]).to(torch.float32) + m


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = read_fp16(blocks[:, 0:2]).unsqueeze(-1)
    q = _nibbles(blocks[:, 6:]) | (_high_bits(blocks[:, 2:6]) << 4)
    return d * (q.to(torch.float32) - 16.0)


def dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = read_fp16(blocks[:, 0:2]).unsqueeze(-1), read_fp16(blocks[:, 2:4]).unsqueeze(-1)
    q = _nibbles(blocks[:, 8:]) | (_high_bits(blocks[:, 4:8]) << 4)
    return d * q.to(torch.float32) + m


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = read_fp16(blocks[:, 0:2]).unsqueeze(-1)
    return blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d
