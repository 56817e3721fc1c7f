"""4-bit codes two per byte along the last dimension (DESIGN.md 3.1): element 2i in the low
nibble, 2i+1 in the high nibble, stored unsigned (int4 as q + 8, uint4 as is); an odd last
dimension is padded with the code of 0.0 of that row. Pure torch, any device.

Codes [-8, 7, 3] (int4) -> nibbles [0, 15, 11] + pad 8 (zero point 0) -> bytes [0xF0, 0x8B].
"""

from __future__ import annotations

import torch


def nibble_offset(signed: bool) -> int:
    """What is added to a code to store it as an unsigned nibble."""
    return 8 if signed else 0


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """[..., n] -> [..., ceil(n / 2)]; a 0-d tensor packs into one byte."""
    if not shape:
        return (1,)
    return (*shape[:-1], (shape[-1] + 1) // 2)


def pack_nibbles(
    codes: torch.Tensor, signed: bool, pad: torch.Tensor | int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Pack int8/uint8 4-bit codes; `pad` (a code, or one per row of the last dimension) fills
    the high nibble of the last byte when the last dimension is odd."""
    rows = codes.reshape(-1, codes.shape[-1] if codes.ndim else 1)  # (R, n)
    n = rows.shape[1]
    u = rows.view(torch.uint8)
    result = (
        out
        if out is not None
        else torch.empty(packed_shape(tuple(codes.shape)), dtype=torch.uint8, device=codes.device)
    )
    packed = result.view(rows.shape[0], (n + 1) // 2)
    offset = nibble_offset(signed)
    even = n // 2
    if even:
        lo, hi = u[:, 0 : 2 * even : 2], u[:, 1 : 2 * even : 2]  # (R, n // 2) each
        torch.add(hi, offset, out=packed[:, :even]).bitwise_and_(0x0F).bitwise_left_shift_(4)
        packed[:, :even].bitwise_or_((lo + offset) & 0x0F)
    if n % 2:
        pad_codes = torch.as_tensor(pad, device=codes.device).to(torch.int16).reshape(-1)
        pad_u = (pad_codes + offset).to(torch.uint8).expand(rows.shape[0])
        last = (u[:, n - 1] + offset) & 0x0F
        packed[:, even] = last | (pad_u << 4)
    return result


def unpack_nibbles(packed: torch.Tensor, shape: tuple[int, ...], signed: bool) -> torch.Tensor:
    """Inverse of pack_nibbles: codes of `shape` as int8 (signed) or uint8."""
    n = shape[-1] if shape else 1
    rows = packed.reshape(-1, (n + 1) // 2)
    out = torch.empty(rows.shape[0], 2 * rows.shape[1], dtype=torch.uint8, device=packed.device)
    torch.bitwise_and(rows, 0x0F, out=out[:, 0::2])
    torch.bitwise_right_shift(rows, 4, out=out[:, 1::2])
    codes = out[:, :n]
    if signed:
        return (codes.to(torch.int8) - 8).reshape(shape)
    return codes.contiguous().reshape(shape)
