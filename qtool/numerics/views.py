"""How a granularity views a tensor: the groups that share one scale, as the kernels walk them.

Per group (and per channel on axis 0) the tensor is the [C, K] matrix of its rows (C = shape[0],
K = the product of the other dims), each row cut into groups of L consecutive elements (L = K
per channel). Per tensor, and per channel on another axis, it is (pre, C, post) with C the
quantization axis (C = 1 per tensor). No copies: every view is of the tensor's own memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from qtool.spec import PerChannel, PerGroup, PerTensor, QSpec, matrix_shape, qparam_shape


def normalize_spec(spec: QSpec, ndim: int) -> QSpec:
    """The spec with its channel axis in [0, ndim); ValueError when the tensor has no such axis."""
    g = spec.granularity
    if not isinstance(g, PerChannel):
        return spec
    if not -ndim <= g.axis < ndim:
        raise ValueError(f"axis {g.axis} is out of range for a {ndim}-D tensor")
    return replace(spec, granularity=PerChannel(g.axis % ndim))


def group_shape(shape: tuple[int, ...], axis: int | None) -> tuple[int, int, int]:
    """(pre, C, post): the tensor seen as C groups of pre*post elements each."""
    if axis is None:
        return (1, 1, math.prod(shape))
    return (math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :]))


def row_group_length(spec: QSpec, shape: tuple[int, ...]) -> int | None:
    """L when the granularity is groups of L consecutive elements of the [C, K] rows (a group,
    or a whole row: per channel on axis 0 of a tensor with 2+ dims); None otherwise."""
    g = spec.granularity
    _, k = matrix_shape(shape)
    if isinstance(g, PerGroup):
        return min(g.size, k)
    if isinstance(g, PerChannel) and g.axis == 0 and len(shape) >= 2:
        return k
    return None


def group_parts(k: int, length: int) -> list[tuple[tuple[int, int, int], slice]]:
    """The full groups of each row, then the shorter last group: ((start, count, L), columns)."""
    full = k // length
    parts = []
    if full:
        parts.append(((0, full, length), slice(0, full)))
    if k % length:
        parts.append(((full * length, 1, k % length), slice(full, full + 1)))
    return parts


def part_view(t2: torch.Tensor, part: tuple[int, int, int], length: int) -> torch.Tensor:
    """(C, count, L') view of columns [start, start + count * L') of a (C, K) matrix."""
    start, count, width = part
    return t2[:, start : start + count * width].view(t2.shape[0], count, width)


def grouped(
    x2: torch.Tensor, length: int, reduce: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """reduce() over each group of a (C, K) matrix, as a (C, ceil(K / L)) tensor."""
    k = x2.shape[1]
    return torch.cat([reduce(part_view(x2, part, length)) for part, _ in group_parts(k, length)], 1)


def channel_range(x: torch.Tensor, spec: QSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (min, max) in x's dtype, in the granularity's qparam shape. One pass."""
    if x.numel() == 0:
        raise ValueError("cannot quantize an empty tensor")
    spec = normalize_spec(spec, x.ndim)
    length = row_group_length(spec, tuple(x.shape))
    if length is not None:
        c, k = matrix_shape(tuple(x.shape))
        x2 = x.reshape(c, k)
        shape = qparam_shape(spec.granularity, tuple(x.shape))
        lo = grouped(x2, length, lambda g: g.amin(dim=2))
        return lo.reshape(shape), grouped(x2, length, lambda g: g.amax(dim=2)).reshape(shape)
    if isinstance(spec.granularity, PerTensor):
        return torch.aminmax(x)  # full reductions: aminmax is one pass and ~1.7x faster
    x3 = x.reshape(group_shape(tuple(x.shape), spec.axis))
    return x3.amin(dim=(0, 2)), x3.amax(dim=(0, 2))


def search_view(x: torch.Tensor, spec: QSpec) -> torch.Tensor:
    """x as the [R, S, A, L] block the mse search takes: per tensor [1, 1, 1, n]; per channel
    on axis a, [C, 1, pre, post] (a strided view: no copy)."""
    if isinstance(spec.granularity, PerTensor):
        return x.view(1, 1, 1, -1)
    pre, channels, post = group_shape(tuple(x.shape), spec.axis)
    return x.view(pre, channels, post).permute(1, 0, 2).unsqueeze(1)
