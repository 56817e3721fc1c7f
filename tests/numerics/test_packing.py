from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from qtool.numerics.packing import pack_nibbles, pack_to_int32, unpack_from_int32, unpack_nibbles


def test_golden_nibbles_by_hand(device: str) -> None:
    # int4 codes [7, -3, 2, 7, -8] (the int4 group golden vector) with zero point 0:
    # unsigned q + 8 = [15, 5, 10, 15, 0], padded with the zero point's code 0 + 8 = 8;
    # bytes: 15 | 5 << 4 = 0x5F, 10 | 15 << 4 = 0xFA, 0 | 8 << 4 = 0x80.
    q = torch.tensor([7, -3, 2, 7, -8], dtype=torch.int8, device=device)
    packed = pack_nibbles(q, signed=True, pad=0)
    assert packed.dtype == torch.uint8 and packed.tolist() == [0x5F, 0xFA, 0x80]
    assert unpack_nibbles(packed, 5, signed=True).tolist() == q.tolist()
    # uint4 codes as they are; pad with a per-row zero point code (here 3 and 12)
    u = torch.tensor([[1, 2, 3], [15, 0, 9]], dtype=torch.uint8, device=device)
    pads = torch.tensor([[3], [12]], dtype=torch.uint8, device=device)
    assert pack_nibbles(u, signed=False, pad=pads).tolist() == [[0x21, 0x33], [0x0F, 0xC9]]


def test_golden_int32_words_by_hand(device: str) -> None:
    # 8-bit [1, 2]: unsigned [129, 130], padded with 0 to a word: 129 + 130 * 2^8 = 33409
    q8 = torch.tensor([[1, 2]], dtype=torch.int8, device=device)
    assert pack_to_int32(q8, 8).tolist() == [[33409]]
    # 4-bit [7, -3, 2, 7, -8]: unsigned [15, 5, 10, 15, 0] at bits 0, 4, 8, 12, 16:
    # 15 + 5 * 16 + 10 * 256 + 15 * 4096 + 0 = 64095
    q4 = torch.tensor([[7, -3, 2, 7, -8]], dtype=torch.int8, device=device)
    assert pack_to_int32(q4, 4).tolist() == [[64095]]
    # a top byte >= 128 makes the word negative (two's complement): [0, 0, 0, 127] -> 255 << 24
    assert pack_to_int32(torch.tensor([[-128, -128, -128, 127]], dtype=torch.int8), 8).tolist() == [
        [(255 << 24) - (1 << 32)]
    ]


def test_zero_points_pack_along_dim_zero(device: str) -> None:
    zp = torch.tensor(
        [[1, -1], [2, -2], [3, -3], [4, -4], [5, -5]], dtype=torch.int8, device=device
    )
    words = pack_to_int32(zp, 8, dim=0)
    assert words.shape == (2, 2)
    assert words[:, 0].tolist() == [129 | 130 << 8 | 131 << 16 | (132 << 24) - (1 << 32), 133]
    assert torch.equal(unpack_from_int32(words, 8, 5, dim=0), zp)


codes4 = arrays(
    np.int8, array_shapes(min_dims=1, max_dims=3, max_side=9), elements=st.integers(-8, 7)
)
codes8 = arrays(
    np.int8, array_shapes(min_dims=1, max_dims=3, max_side=9), elements=st.integers(-128, 127)
)


@given(q=codes4, pad=st.integers(-8, 7))
def test_nibbles_round_trip(q: np.ndarray, pad: int) -> None:
    t = torch.from_numpy(q)
    assert torch.equal(unpack_nibbles(pack_nibbles(t, True, pad), q.shape[-1], True), t)
    u = (t + 8).to(torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(u, False, pad + 8), q.shape[-1], False), u)


@given(q=codes4, dim=st.integers(0, 2))
def test_int32_four_bit_round_trip(q: np.ndarray, dim: int) -> None:
    dim = dim % q.ndim
    t = torch.from_numpy(q)
    words = pack_to_int32(t, 4, dim)
    assert words.shape[dim] == -(-q.shape[dim] // 8)
    assert torch.equal(unpack_from_int32(words, 4, q.shape[dim], dim), t)


@given(q=codes8)
def test_int32_eight_bit_words_are_the_offset_bytes_little_endian(q: np.ndarray) -> None:
    t = torch.from_numpy(q)
    words = pack_to_int32(t, 8)
    assert torch.equal(unpack_from_int32(words, 8, q.shape[-1]), t)
    if q.shape[-1] % 4 == 0:  # no padding: the words are the bytes q + 128, read as <i4
        offset = (q.astype(np.int16) + 128).astype(np.uint8)
        assert np.array_equal(words.numpy(), np.ascontiguousarray(offset).view("<i4"))


def test_packing_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_nibbles(torch.tensor([8], dtype=torch.int16), signed=True)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_nibbles(torch.tensor([16], dtype=torch.uint8), signed=False)
    with pytest.raises(ValueError, match="3 bytes"):
        unpack_nibbles(torch.zeros(2, dtype=torch.uint8), 5, signed=True)
    with pytest.raises(ValueError, match="1, 2, 4 or 8 bits"):
        pack_to_int32(torch.zeros(4, dtype=torch.int8), 3)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_to_int32(torch.tensor([9], dtype=torch.int8), 4)
    with pytest.raises(ValueError, match="int32"):
        unpack_from_int32(torch.zeros(1, dtype=torch.int64), 8, 4)
