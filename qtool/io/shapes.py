"""Shapes read from files: the one check every reader applies before it trusts a shape.

A shape whose element count overflows a 64-bit integer cannot be held by torch or numpy, and
the reference safetensors parser refuses it: it multiplies the dims in order with checked
arithmetic, so `[2**62, 2**62, 0]` overflows at its second dim although its product is 0.
qtool's readers compute in Python integers, which never overflow, and so would accept such a
shape and hand it on (to a writer, to torch) to fail later or write a file nobody loads.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_ELEMENTS = (1 << 63) - 1
"""int64's largest value: torch and numpy count elements in int64; safetensors' own limit,
usize, is 2**64 - 1, so every shape it refuses for overflow is refused here too."""


def overflowing_prefix(shape: Sequence[int]) -> int | None:
    """How many leading dims of `shape` first multiply to over MAX_ELEMENTS (a zero dim after
    them does not help: each prefix is checked, as safetensors checks it); None when none do."""
    count = 1
    for i, dim in enumerate(shape):
        count *= dim
        if count > MAX_ELEMENTS or dim > MAX_ELEMENTS:
            return i + 1
    return None


def shape_overflow(shape: Sequence[int]) -> str | None:
    """Why `shape` cannot be a tensor's (the words for an error naming file and tensor), or
    None when its every prefix product fits int64."""
    k = overflowing_prefix(shape)
    if k is None:
        return None
    return (
        f"shape {list(shape)} overflows: the product of its first {k} dims is over 2**63 - 1 "
        "(int64), which no tensor library can hold"
    )
