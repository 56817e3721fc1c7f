"""The C arithmetic the GGUF kernels emulate, each against an independent definition."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from qtool.numerics.gguf import cops


def test_nearest_int_rounds_half_to_even_within_its_range(device: str) -> None:
    ties = np.arange(-4096, 4096, dtype=np.float32) + np.float32(0.5)
    rand = np.random.default_rng(0).uniform(-4194303, 4194303, 100_000).astype(np.float32)
    x = np.concatenate([ties, rand, np.float32([0.0, -0.0, 4194303.0, -4194303.0])])
    ours = cops.nearest_int(torch.from_numpy(x).to(device)).cpu().numpy()
    assert (ours == np.rint(x).astype(np.int64)).all()  # np.rint: half to even


def test_nearest_int_outside_its_range_is_the_bit_trick_and_nan_is_zero() -> None:
    x = torch.tensor([1e10, -1e10, float("inf"), float("-inf"), float("nan")])
    # the low 23 bits of the float32 sum x + 1.5 * 2**23, less 2**22, whatever x
    sums = np.float32([1e10, -1e10]) + np.float32(12582912.0)
    expected = [*((sums.view(np.int32) & 0x7FFFFF) - 0x400000).tolist(), -0x400000, -0x400000, 0]
    assert cops.nearest_int(x).tolist() == expected


@given(bits=st.integers(0, 0x7F7FFFFF))
def test_sqrtf_is_correctly_rounded(bits: int) -> None:
    f = np.array([bits], dtype=np.uint32).view(np.float32)  # every finite float >= 0
    assert cops.sqrtf(torch.from_numpy(f)).numpy().view(np.uint32) == np.sqrt(f).view(np.uint32)


def test_sqrtf_where_torch_sqrt_is_one_ulp_off_and_at_the_edges(device: str) -> None:
    x = np.random.default_rng(1).uniform(0, 1e-3, 200_000).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, 1e-45, 1e-40, 3.4e38, np.inf])])
    ours = cops.sqrtf(torch.from_numpy(x).to(device)).cpu().numpy()
    assert (ours.view(np.uint32) == np.sqrt(x).view(np.uint32)).all()


def test_c_trunc_and_roundf_as_x86_c_casts() -> None:
    x = torch.tensor([2.7, -2.7, 0.49999997, 2.5, -2.5, 3e9, float("nan"), float("inf")])
    assert cops.c_trunc(x).tolist() == [2, -2, 0, 2, -2, -(2**31), -(2**31), -(2**31)]
    assert cops.c_roundf(x[:5]).tolist() == [3.0, -3.0, 0.0, 3.0, -3.0]  # half away from 0


def test_seqsum_adds_in_loop_order_from_plus_zero() -> None:
    terms = torch.tensor([[1e8], [1.0], [-1e8], [1.0]])
    assert cops.seqsum(terms).item() == 1.0  # ((1e8 + 1) - 1e8) + 1: the 1 is lost first
    assert str(cops.seqsum(torch.tensor([[-0.0]])).item()) == "0.0"


def test_fp16_bytes_round_to_nearest_even_and_overflow_to_inf() -> None:
    x = torch.tensor([1.0 + 2**-11, 1.0 + 3 * 2**-11, 65519.0, 65520.0, -1e-8])
    got = cops.fp16_bytes(x).view(torch.float16).flatten()
    assert got.tolist() == [1.0, 1.0 + 2**-9, 65504.0, float("inf"), -0.0]
