"""`calibrate --merge` never writes sensitivities qtool then refuses to read: a token count
reaching 2^63 (what read_sensitivities takes) is refused naming the input that reaches it;
alphas near the float range merge to their finite token-weighted mean (alpha x tokens summed
overflowed to inf, written as such)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from qtool.errors import InputError
from qtool.formats.imatrix.sensitivity import Sensitivities, merged


def test_a_merged_token_count_reaching_2_63_is_refused_naming_the_input() -> None:
    a, b = Path("a.gguf"), Path("b.gguf")
    found = {a: Sensitivities({"w": 1.0}, "ref", 1 << 62),
             b: Sensitivities({"w": 2.0}, "ref", 1 << 62)}  # fmt: skip
    with pytest.raises(InputError) as caught:
        merged(found)
    assert caught.value.path == str(b) and "2^63" in caught.value.message
    below = {a: found[a], b: Sensitivities({"w": 2.0}, "ref", (1 << 62) - 1)}
    result = merged(below)
    assert result is not None and result.tokens == (1 << 63) - 1


@pytest.mark.parametrize("tokens", [(1, 1), (1 << 40, 3), (3, 1 << 62)])
def test_large_alphas_merge_to_their_finite_weighted_mean(tokens: tuple[int, int]) -> None:
    big = 1.5e308
    found = {Path("a"): Sensitivities({"w": big, "v": 1.0}, "ref", tokens[0]),
             Path("b"): Sensitivities({"w": big, "v": 3.0}, "ref", tokens[1])}  # fmt: skip
    result = merged(found)
    assert result is not None
    assert math.isfinite(result.alpha["w"]) and result.alpha["w"] == pytest.approx(big)
    expect = (1.0 * tokens[0] + 3.0 * tokens[1]) / sum(tokens)
    assert result.alpha["v"] == pytest.approx(expect)
