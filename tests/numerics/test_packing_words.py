"""stored_to_int32: compressed-tensors words straight from qtool's stored codes, in one pass,
equal to the two-pass reference (unpack the nibbles, then pack_to_int32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from qtool.numerics.packing import pack_nibbles, pack_to_int32, stored_to_int32

codes4 = arrays(
    np.int8, array_shapes(min_dims=1, max_dims=3, max_side=19), elements=st.integers(-8, 7)
)
codes8 = arrays(
    np.int8, array_shapes(min_dims=1, max_dims=3, max_side=19), elements=st.integers(-128, 127)
)


@given(q=codes4, pad=st.integers(-8, 7))
def test_4bit_words_equal_the_two_pass_reference(q: np.ndarray, pad: int) -> None:
    codes = torch.from_numpy(q)
    stored = pack_nibbles(codes, signed=True, pad=pad)  # an odd row's pad: any zero point's code
    words = stored_to_int32(stored, 4, q.shape[-1])
    assert words.dtype == torch.int32
    assert torch.equal(words, pack_to_int32(codes, 4))


@given(q=codes8)
def test_8bit_words_equal_the_reference(q: np.ndarray) -> None:
    codes = torch.from_numpy(q)
    assert torch.equal(stored_to_int32(codes, 8, q.shape[-1]), pack_to_int32(codes, 8))


def test_whole_words_of_4bit_codes_are_a_view_not_a_copy() -> None:
    stored = pack_nibbles(torch.randint(-8, 8, (3, 64), dtype=torch.int8), signed=True)
    words = stored_to_int32(stored, 4, 64)
    assert words.data_ptr() == stored.data_ptr() and words.shape == (3, 8)


def test_golden_odd_row_pads_with_unsigned_zero() -> None:
    # [7, -3, 2, 7, -8] -> unsigned [15, 5, 10, 15, 0] (+ pad nibble 8 in qtool's bytes):
    # 15 + 5 * 16 + 10 * 256 + 15 * 4096 + 0 = 64095, the pad nibble cleared
    stored = torch.tensor([[0x5F, 0xFA, 0x80]], dtype=torch.uint8)
    assert stored_to_int32(stored, 4, 5).tolist() == [[64095]]


@pytest.mark.parametrize(
    ("q", "bits", "n"),
    [
        (torch.zeros(2, 3, dtype=torch.int8), 4, 5),  # 4-bit codes must be packed bytes
        (torch.zeros(2, 2, dtype=torch.uint8), 4, 5),  # 5 codes take 3 bytes
        (torch.zeros(2, 3, dtype=torch.uint8), 8, 3),  # 8-bit codes are int8
    ],
    ids=["unpacked-4bit", "wrong-width", "uint8-8bit"],
)
def test_refuses_codes_not_as_stored(q: torch.Tensor, bits: int, n: int) -> None:
    with pytest.raises(ValueError, match="stored as"):
        stored_to_int32(q, bits, n)
