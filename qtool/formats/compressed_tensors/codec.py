"""compressed-tensors tensors: encode one Linear weight as `pack-quantized`, decode any supported
layout back to float (torch).

Encoding quantizes with the kernels (float32 division against the scale already rounded to the
weight's dtype, round half to even) and writes, for module P (N x K weight):
  P.weight_packed     int32 [N, ceil(K * bits / 32)]  signed codes packed along K
  P.weight_scale      weight dtype, [N, 1] (channel; per tensor repeated) or [N, K / G]
  P.weight_zero_point int32 [ceil(N * bits / 32), groups], packed along N (asymmetric only)
  P.weight_shape      int64 [2] = [N, K]
qtool's symmetric int8 codes lie in [-127, 127] with scale amax / 127: every reader computes
(q - zero_point) * scale, so that is as valid as compressed-tensors' own amax / 127.5.

Decoding computes x_hat = (q - zero_point) * scale in float32 and casts to the scale's dtype:
bit-identical to compressed-tensors' decompressor, which computes in the scale's dtype (the
integer difference and the product are exact in float32 for bf16/fp16 scales, so both round once).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from qtool.formats.compressed_tensors.config import NAIVE_FORMATS, CtArgs
from qtool.formats.compressed_tensors.schemes import COMPONENTS, CtModule, packed_words
from qtool.formats.compressed_tensors.selection import check_spec
from qtool.numerics import kernels
from qtool.numerics.packing import pack_to_int32, stored_to_int32
from qtool.spec import PerGroup, PerTensor, QSpec, Scheme

SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP16_SMALLEST_NORMAL = torch.finfo(torch.float16).tiny
_ROWS_PER_CHUNK_ELEMS = 1 << 22  # bound the int64 temporaries of unpacking


@dataclass(frozen=True)
class Encoded:
    """One Linear weight as compressed-tensors stores it, with the kernels' result."""

    tensors: dict[str, torch.Tensor]  # local names: weight_packed, weight_scale, ...
    quantized: kernels.QuantizedTensor


def encode_weight(weight: torch.Tensor, spec: QSpec, *, with_errors: bool = True) -> Encoded:
    """The pack-quantized tensors of a 2-D Linear weight; ValueError when compressed-tensors
    cannot hold it (uint dtypes, another axis, K not a multiple of G, not bf16/fp16/fp32)."""
    _check_weight(weight, spec)
    n, k = weight.shape
    qt = kernels.quantize_tensor(weight, spec, with_errors=with_errors, scale_dtype=weight.dtype)
    return Encoded(encode_result(qt, spec, (n, k), weight.dtype), qt)


def encode_result(
    qt: kernels.QuantizedTensor, spec: QSpec, shape: tuple[int, int], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The pack-quantized tensors (local names, on the CPU) of the kernels' result for an
    N x K weight of `dtype`, quantized with scales already rounded to `dtype`."""
    n, k = shape
    bits = spec.dtype.bits
    tensors = {
        "weight_packed": stored_to_int32(qt.q.cpu(), bits, k),  # one pass (4-bit: often none)
        "weight_scale": _per_row(qt.scale.cpu(), spec, n).to(dtype),
    }
    if spec.scheme is Scheme.ASYM:
        zero_point = _per_row(qt.zero_point.cpu(), spec, n).to(torch.int8)
        tensors["weight_zero_point"] = pack_to_int32(zero_point, bits, dim=0)
    tensors["weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
    return {name: t.contiguous() for name, t in tensors.items()}  # as writers need


def _check_weight(weight: torch.Tensor, spec: QSpec) -> None:
    check_spec(spec)
    if weight.ndim != 2:
        raise ValueError(f"a Linear weight is 2-D, got shape {tuple(weight.shape)}")
    if weight.dtype not in SCALE_DTYPES:
        raise ValueError(
            f"compressed-tensors export needs bf16/fp16/fp32 weights, got {weight.dtype}"
        )
    g = spec.granularity
    if isinstance(g, PerGroup) and weight.shape[1] % g.size:
        raise ValueError(f"group size {g.size} does not divide K = {weight.shape[1]}")


def _per_row(values: torch.Tensor, spec: QSpec, n: int) -> torch.Tensor:
    """qparams as [N, groups]: per channel [N] -> [N, 1], per tensor () repeated to [N, 1]."""
    if isinstance(spec.granularity, PerTensor):
        return values.reshape(1, 1).expand(n, 1).contiguous()
    return values.reshape(n, -1)


def kernel_dequantized(
    encoded: Encoded, spec: QSpec, shape: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The kernels' own dequantization of an encoded weight (the round-trip reference)."""
    qt = encoded.quantized
    return kernels.dequantize(qt.q, qt.scale, qt.zero_point, spec, dtype=dtype, shape=shape)


def fp16_underflow_warning(name: str, scale: torch.Tensor) -> str | None:
    """One line when float16 scales fell below float16's smallest normal (they keep only a few
    significant bits there); None otherwise."""
    if scale.dtype != torch.float16:
        return None
    count = int((scale.abs() < FP16_SMALLEST_NORMAL).sum())
    if not count:
        return None
    return (
        f"{name}: {count} of {scale.numel()} float16 scales are subnormal (< 6.1e-05) and lose "
        "precision; quantize a bfloat16/float32 copy or exclude the tensor"
    )


# ---------------------------------------------------------------- decoding


def unpack_bits(words: torch.Tensor, bits: int, n: int, dim: int = -1) -> torch.Tensor:
    """int8 signed codes (n along `dim`) from compressed-tensors int32 words of any width
    1..8: element i sits at bit i * bits of the row's little-endian bit stream (codes may
    straddle two words), stored as the unsigned code q + 2^(bits - 1)."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed words must be int32, got {words.dtype}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    w = words.movedim(dim, -1)
    if w.shape[-1] != packed_words(n, bits):
        raise ValueError(
            f"{n} codes of {bits} bits pack into {packed_words(n, bits)} words, got {w.shape[-1]}"
        )
    if 8 % bits == 0 and sys.byteorder == "little":
        return _unpack_bytes(w, bits, n).movedim(-1, dim)
    w64 = torch.nn.functional.pad(
        w.to(torch.int64) & 0xFFFFFFFF, (0, 1)
    )  # a zero word to spill into
    pos = torch.arange(n, dtype=torch.int64, device=words.device) * bits
    word, offset = pos // 32, pos % 32
    u = ((w64[..., word] >> offset) | (w64[..., word + 1] << (32 - offset))) & ((1 << bits) - 1)
    return (u - (1 << (bits - 1))).to(torch.int8).movedim(-1, dim)


def _unpack_bytes(w: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """unpack_bits for widths that divide a byte (no code straddles one): the words' bytes in
    memory order are the bit stream's (little-endian), so each byte gives 8 // bits codes, low
    bits first; a byte per code of intermediates instead of the general path's int64 gathers
    (22 of compare's 72-95 s on SmolLM2's int4 export, issue 33)."""
    u8 = w.contiguous().view(torch.uint8)
    if bits == 8:
        u = u8[..., :n]
    else:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=w.device)
        u = ((u8[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)[..., :n]
    return (u.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def module_codes(
    tensors: Mapping[str, torch.Tensor], args: CtArgs, fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [N, K], zero points int8 [N or 1, groups]) of one module's local tensors."""
    if fmt in NAIVE_FORMATS:
        q = _require(tensors, "weight", torch.int8)
        zp = tensors.get("weight_zero_point")
        return q, _zero_point(zp, args, q.shape[0], packed=False)
    packed = _require(tensors, "weight_packed", torch.int32)
    n, k = (int(v) for v in _require(tensors, "weight_shape", None).tolist())
    q = _unpack_rows(packed, args.num_bits, n, k)
    zp = tensors.get("weight_zero_point")
    return q, _zero_point(zp, args, n, packed=args.strategy != "tensor")


def _unpack_rows(packed: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    if packed.ndim != 2 or packed.shape[0] != n:
        raise ValueError(f"weight_packed has shape {tuple(packed.shape)}, expected {n} rows")
    step = max(1, _ROWS_PER_CHUNK_ELEMS // max(1, k))
    return torch.cat([unpack_bits(packed[r : r + step], bits, k) for r in range(0, n, step)])


def _zero_point(zp: torch.Tensor | None, args: CtArgs, n: int, packed: bool) -> torch.Tensor:
    """Signed zero points [N or 1, groups] (zeros when symmetric; a stored zero point under a
    symmetric scheme is a contradiction, refused rather than ignored)."""
    if args.symmetric:
        if zp is not None:
            raise ValueError(
                "weight_zero_point is stored but the scheme says symmetric; the config and the "
                "tensors disagree (check `symmetric` in its config group)"
            )
        return torch.zeros(1, 1, dtype=torch.int8)
    if zp is None:
        raise ValueError("asymmetric scheme without weight_zero_point")
    if packed:  # int32 words along the output dimension (trap T10: not for the tensor strategy)
        return unpack_bits(zp, args.num_bits, n, dim=0)
    return zp.reshape(-1, 1) if args.strategy == "tensor" else zp


def _require(
    tensors: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype | None
) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"missing {name}")
    t = tensors[name]
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    return t


def dequantize_module(tensors: Mapping[str, torch.Tensor], args: CtArgs, fmt: str) -> torch.Tensor:
    """x_hat [N, K] in the scale's dtype: (q - zero_point) * scale in float32, cast once. The
    scale is validated first (check_scale), its shape against the strategy, the zero point's
    against the scale's."""
    q, zp = module_codes(tensors, args, fmt)
    scale = _require(tensors, "weight_scale", None)
    n, k = q.shape
    groups = _scale_groups(args, scale, n, k)
    if zp.numel() != 1 and tuple(zp.shape) not in ((n, groups), (1, groups)):
        raise ValueError(
            f"weight_zero_point of shape {tuple(zp.shape)} does not fit {args.strategy} "
            f"scales of shape {tuple(scale.shape)}"
        )
    check_scale(scale, q, zp)
    if args.strategy == "group":
        g = k // groups
        diff = q.view(n, groups, g).float() - zp.float().reshape(zp.shape[0], -1, 1)
        out = (diff * scale.float().reshape(n, -1, 1)).reshape(n, k)
    elif args.strategy == "tensor":
        out = (q.float() - zp.float().reshape(-1)[0]) * scale.float().reshape(())
    else:
        out = (q.float() - zp.float().reshape(zp.shape[0], -1)) * scale.float().reshape(-1, 1)
    return out.to(scale.dtype)


def _scale_groups(args: CtArgs, scale: torch.Tensor, n: int, k: int) -> int:
    """Groups per row that `scale`'s shape holds for this strategy (ValueError when the shape
    disagrees with the strategy: channel scales are [N, 1] or [N], groups [N, K / G], tensor
    one value)."""
    shape = tuple(scale.shape)
    if args.strategy == "group":
        g = args.group_size
        assert g is not None
        if k % g or shape != (n, k // g):
            raise ValueError(
                f"strategy group {g}: weight_scale of shape {shape} does not fit a [{n}, {k}] "
                f"weight (expected [{n}, {k // g if not k % g else f'{k}/{g}'}])"
            )
        return k // g
    if args.strategy == "channel" and shape not in ((n, 1), (n,)):
        raise ValueError(
            f"strategy channel: weight_scale of shape {shape} does not fit a [{n}, {k}] weight "
            f"(expected [{n}, 1]; the config's strategy and the scales disagree)"
        )
    if args.strategy == "tensor" and scale.numel() != 1:
        raise ValueError(
            f"strategy tensor: weight_scale of shape {shape} holds {scale.numel()} values, "
            "not one (the config's strategy and the scales disagree)"
        )
    return 1


def check_scale(scale: torch.Tensor, q: torch.Tensor, zp: torch.Tensor) -> None:
    """The qtool sidecar's rules for a scale read from someone else's file: a float dtype,
    every value finite and positive, and no code that dequantizes to infinity in that dtype."""
    if not scale.dtype.is_floating_point:
        raise ValueError(f"weight_scale is {scale.dtype}, not a float tensor")
    values = scale.float()
    if not bool(values.isfinite().all()) or bool((values <= 0).any()):
        raise ValueError("weight_scale holds zero, negative, NaN or Inf values")
    if q.numel():
        reach = (q.float().abs().amax() + zp.float().abs().amax()) * values.amax()
        if not bool(torch.isfinite(reach.to(scale.dtype))):
            raise ValueError(
                f"weight_scale values so large that codes dequantize to infinity in {scale.dtype}"
            )


def dequantize_named(
    module: CtModule, read: Callable[[str], torch.Tensor], names: Iterable[str]
) -> torch.Tensor:
    """`module`'s float weight, reading its tensors by full name with `read` (ValueError
    prefixed with the module name when they do not fit its scheme)."""
    local = module.tensor_names(names)
    try:
        tensors = {k: read(full) for k, full in local.items() if k in COMPONENTS}
        return dequantize_module(tensors, module.group.weights, module.group.format)
    except ValueError as err:
        raise ValueError(f"{module.module}: {err}") from None
