"""Granularity: which elements share one scale and zero point, and the views kernels work on.

Every granularity cuts a contiguous tensor into blocks, strided views of shape [R, S, A, L]
(no copies): group (r, s) of a block is `values[r, s]` (A * L elements), and its qparams sit
at `grid[r, col0 + s]` of an [R, n] qparam grid, stored reshaped to `qparam_shape(shape)`:

  per tensor          one block [1, 1, C, K]   (x seen as [C, K])        grid [1, 1] -> ()
  per channel (axis)  one block [C, 1, pre, post] (axis moved first)    grid [C, 1] -> (C,)
  per group of G      x seen as [C, K] (C = shape[0], K = the other dims, row-major):
                      full groups [C, K // G, 1, G], then, when G does not divide K, the
                      shorter last group [C, 1, 1, K % G]                grid [C, ceil(K / G)]

Keeping the shorter last group as its own block (rather than padding or copying the full
part into [C * K // G, G] rows, which is not a view when K % G != 0) leaves the tensor in
place and every group exactly as DESIGN.md 3.1 defines it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Block:
    """A view [R, S, A, L] of part of a tensor whose groups fill grid columns col0 .. col0+S."""

    values: torch.Tensor
    col0: int


@dataclass(frozen=True)
class GroupedView:
    """A tensor cut into groups: its blocks and the (R, n) qparam grid they fill."""

    blocks: tuple[Block, ...]
    grid: tuple[int, int]


@dataclass(frozen=True)
class PerTensor:
    """One scale and zero point for the whole tensor."""

    def qparam_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """() : a scalar scale."""
        return ()

    def grid(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return (1, 1)

    def view(self, x: torch.Tensor) -> GroupedView:
        """The whole tensor as one group, laid out [1, 1, C, K]."""
        _check_contiguous(x)
        rows = x.shape[0] if x.ndim else 1
        return GroupedView((Block(x.view(1, 1, rows, -1), 0),), (1, 1))

    def describe(self) -> str:
        return "tensor"

    def to_json(self) -> dict[str, Any]:
        return {"kind": "tensor"}


@dataclass(frozen=True)
class PerChannel:
    """One scale per slice along `axis` (negative axes count from the end)."""

    axis: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise ValueError(f"channel axis must be an integer, got {self.axis!r}")

    def resolve(self, ndim: int) -> int:
        """The axis in [0, ndim); ValueError when it does not exist."""
        if not -ndim <= self.axis < ndim:
            raise ValueError(f"axis {self.axis} is out of range for a {ndim}-D tensor")
        return self.axis % ndim

    def qparam_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """(C,) with C = shape[axis]."""
        return (shape[self.resolve(len(shape))],)

    def grid(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return (self.qparam_shape(shape)[0], 1)

    def view(self, x: torch.Tensor) -> GroupedView:
        """[C, 1, pre, post]: the (pre, C, post) view with the channel dim moved first."""
        _check_contiguous(x)
        axis = self.resolve(x.ndim)
        shape = tuple(x.shape)
        pre, channels = math.prod(shape[:axis]), shape[axis]
        x3 = x.view(pre, channels, math.prod(shape[axis + 1 :]))  # (pre, C, post)
        block = x3.permute(1, 0, 2).unsqueeze(1)  # (C, 1, pre, post), a strided view
        return GroupedView((Block(block, 0),), (channels, 1))

    def describe(self) -> str:
        return f"axis {self.axis}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": "channel", "axis": self.axis}


@dataclass(frozen=True)
class PerGroup:
    """Rows of the [C, K] view cut into ceil(K / G) groups of G consecutive elements."""

    size: int

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int):
            raise ValueError(f"group size must be an integer, got {self.size!r}")
        if self.size < 2:
            raise ValueError(f"group size must be at least 2, got {self.size}")

    def rows_cols(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """(C, K): the [C, K] view of a tensor of `shape`; ValueError for a 0-d tensor."""
        if not shape:
            raise ValueError("a 0-d tensor has no rows to cut into groups; quantize it per tensor")
        return shape[0], math.prod(shape[1:])

    def n_groups(self, shape: tuple[int, ...]) -> int:
        """ceil(K / G): groups per row (1 when G >= K: then it is per channel along axis 0)."""
        return -(-self.rows_cols(shape)[1] // self.size)

    def qparam_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """(C, ceil(K / G))."""
        return (self.rows_cols(shape)[0], self.n_groups(shape))

    def grid(self, shape: tuple[int, ...]) -> tuple[int, int]:
        rows, n = self.qparam_shape(shape)
        return (rows, n)

    def view(self, x: torch.Tensor) -> GroupedView:
        """Full groups [C, K // G, 1, G]; when G does not divide K, the tail [C, 1, 1, K % G]."""
        _check_contiguous(x)
        rows, cols = self.rows_cols(tuple(x.shape))
        x2 = x.view(rows, cols)
        full, tail = divmod(cols, self.size)
        blocks = []
        if full:
            blocks.append(Block(x2[:, : full * self.size].view(rows, full, 1, self.size), 0))
        if tail:
            blocks.append(Block(x2[:, full * self.size :].view(rows, 1, 1, tail), full))
        return GroupedView(tuple(blocks), (rows, full + (1 if tail else 0)))

    def describe(self) -> str:
        return f"group {self.size}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": "group", "size": self.size}


Granularity = PerTensor | PerChannel | PerGroup


def from_json(data: dict[str, Any]) -> Granularity:
    """Inverse of `to_json`; ValueError naming what is wrong with `data`."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "tensor":
        return PerTensor()
    if kind == "channel" and "axis" in data:
        return PerChannel(data["axis"])
    if kind == "group" and "size" in data:
        return PerGroup(data["size"])
    raise ValueError(
        f"unknown granularity {data!r}: expected kind 'tensor', 'channel' (with axis) "
        "or 'group' (with size)"
    )


def _check_contiguous(x: torch.Tensor) -> None:
    if not x.is_contiguous():
        raise ValueError("grouped views need a contiguous tensor (call .contiguous() first)")
