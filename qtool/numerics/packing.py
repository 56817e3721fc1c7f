"""Bit packing of integer codes: 4-bit nibbles (qtool format) and int32 words (compressed-tensors).

Nibbles (docs/numerics.md, "4-bit codes"): two codes per byte along the last dimension,
element 2i in the low nibble and 2i+1 in the high one, as unsigned codes (int4 stored as q + 8,
uint4 as is); an odd last dimension is padded with a given code (the zero point's, so the pad
dequantizes to 0.0).
  int4 [-8, 7, 1] padded with 0: unsigned [0, 15, 9, 8] -> bytes [0xF0, 0x89]

int32 words (compressed-tensors pack_to_int32): signed codes of `bits` bits are offset by
2^(bits-1) to unsigned, element i of each run of 32 / bits sits at bits [i*bits, (i+1)*bits) of
its word, the packed dimension is padded with unsigned 0 to a whole word, and the word is read
as a two's-complement int32.  8-bit [1, 2] -> unsigned [129, 130] -> 129 + 130 * 256 = 33409.
"""

from __future__ import annotations

import sys

import torch

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def pack_nibbles(q: torch.Tensor, signed: bool, pad: int | torch.Tensor = 0) -> torch.Tensor:
    """uint8 [..., ceil(n / 2)] from 4-bit codes [..., n]; `pad` (a code, or codes shaped like
    q[..., :1]) fills the high nibble of the last byte when n is odd."""
    if q.ndim == 0:
        raise ValueError("cannot pack a 0-d tensor; reshape it to 1-D first")
    u = _to_unsigned4(q, signed)
    if u.shape[-1] % 2:
        fill = torch.as_tensor(pad, device=q.device).expand(*q.shape[:-1], 1)
        u = torch.cat([u, _to_unsigned4(fill, signed)], dim=-1)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, n: int, signed: bool) -> torch.Tensor:
    """Codes [..., n] (int8 when signed, else uint8) from bytes [..., ceil(n / 2)]."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed nibbles must be uint8, got {packed.dtype}")
    if packed.ndim == 0 or packed.shape[-1] != -(-n // 2):
        raise ValueError(f"{n} codes pack into {-(-n // 2)} bytes, got shape {tuple(packed.shape)}")
    u = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)[..., :n]
    return (u.to(torch.int8) - 8) if signed else u


def pack_to_int32(q: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """int32 words packing signed `bits`-bit codes (bits in 1, 2, 4, 8) along `dim`."""
    per_word = _per_word(bits)
    if q.dtype not in _INT_DTYPES:
        raise ValueError(f"codes must be an integer tensor, got {q.dtype}")
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"codes must lie in [{lo}, {hi}] for {bits}-bit packing")
    u = q.movedim(dim, -1).to(torch.int64) + (1 << (bits - 1))
    n = u.shape[-1]
    u = torch.nn.functional.pad(u, (0, -n % per_word))  # unsigned 0 up to a whole word
    shifts = torch.arange(per_word, device=q.device, dtype=torch.int64) * bits
    words = (u.view(*u.shape[:-1], -1, per_word) << shifts).sum(dim=-1)  # disjoint bits: sum == or
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # two's complement
    return words.to(torch.int32).movedim(-1, dim)


def stored_to_int32(q: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """`pack_to_int32(codes, bits)` along the last dimension, straight from signed codes as
    qtool stores them (8-bit: int8 [..., n]; 4-bit: nibbles [..., ceil(n / 2)] from
    pack_nibbles), in one pass. The bits already agree: a byte holds the unsigned code
    q + 2^(bits - 1) (int8: its top bit flipped), and element i of a word sits at bits
    [i * bits, (i + 1) * bits) of four little-endian bytes. So 4-bit rows of a multiple of 8
    codes are their words as they are (a view, no copy); others are copied once into
    zero-padded rows (an odd row's pad nibble, the zero point's code in qtool, becomes the 0
    compressed-tensors pads with)."""
    per_word = _per_word(bits)
    if bits not in (4, 8) or sys.byteorder != "little":
        codes = unpack_nibbles(q, n, signed=True) if bits == 4 else q
        return pack_to_int32(codes, bits)
    width = -(-n // 2) if bits == 4 else n
    expected = torch.uint8 if bits == 4 else torch.int8
    if q.ndim == 0 or q.shape[-1] != width or q.dtype != expected:
        raise ValueError(
            f"{n} {bits}-bit codes are stored as {expected} [..., {width}], got {q.dtype} "
            f"{tuple(q.shape)}"
        )
    words = -(-n // per_word)
    rows = q.reshape(-1, width)
    if bits == 4 and width == 4 * words and not n % 2 and rows.is_contiguous():
        return rows.view(torch.int32).view(*q.shape[:-1], words)
    out = torch.empty(rows.shape[0], 4 * words, dtype=torch.uint8, device=q.device)
    out[:, width:] = 0
    if bits == 8:
        torch.bitwise_xor(rows.view(torch.uint8), 0x80, out=out[:, :width])
    else:
        out[:, :width] = rows
        if n % 2:
            out[:, width - 1] &= 0x0F
    return out.view(torch.int32).view(*q.shape[:-1], words)


def unpack_from_int32(words: torch.Tensor, bits: int, n: int, dim: int = -1) -> torch.Tensor:
    """int8 signed codes with `n` elements along `dim`, from `pack_to_int32` words."""
    per_word = _per_word(bits)
    if words.dtype != torch.int32:
        raise ValueError(f"packed words must be int32, got {words.dtype}")
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    if w.shape[-1] != -(-n // per_word):
        raise ValueError(f"{n} codes pack into {-(-n // per_word)} words, got {w.shape[-1]}")
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int64) * bits
    u = ((w[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)[..., :n]
    return (u - (1 << (bits - 1))).to(torch.int8).movedim(-1, dim)


def _to_unsigned4(q: torch.Tensor, signed: bool) -> torch.Tensor:
    wide = q.to(torch.int16) + (8 if signed else 0)
    if wide.numel() and (int(wide.min()) < 0 or int(wide.max()) > 15):
        kind = "int4 codes must lie in [-8, 7]" if signed else "uint4 codes must lie in [0, 15]"
        raise ValueError(kind)
    return wide.to(torch.uint8)


def _per_word(bits: int) -> int:
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"int32 packing supports 1, 2, 4 or 8 bits, got {bits}")
    return 32 // bits
