from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.numerics.budget import (
    DEFAULT_LADDER,
    Choice,
    bytes_per_tensor,
    candidates,
    choose,
)
from qtool.numerics.kernels import (
    Workspace,
    dequantize,
    quantize_with,  # what the budget runs (QTOOL_KERNEL)
)
from qtool.numerics.ranges import NonFiniteInput
from qtool.results import Trial
from qtool.spec import QSpec, parse_spec_label, spec_label


def specs(*labels: str) -> tuple[QSpec, ...]:
    return tuple(parse_spec_label(label) for label in labels)


def labels(spec_list: tuple[QSpec, ...] | list[QSpec]) -> list[str]:
    return [spec_label(s) for s in spec_list]


def gaussian(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def with_outliers(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    """N(0, 1) with one value of +-30 at the start of every 32 elements of each row."""
    x = gaussian((rows, cols), seed)
    signs = torch.randint(0, 2, (rows, cols // 32), generator=torch.Generator().manual_seed(seed))
    x.view(rows, cols // 32, 32)[:, :, 0] = 30.0 * (2.0 * signs - 1.0)
    return x


# -- sizes and order ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("label", "shape", "expected"),
    [
        ("int8", (10, 64), 10 * 64 + 5 * 10),
        ("int8 tensor", (7,), 7 + 5),
        ("int4 g32", (4, 100), 4 * 50 + 5 * 4 * 4),  # ceil(100 / 32) = 4 groups per row
        ("int4", (3, 5), 3 * 3 + 5 * 3),  # odd rows pad to 3 bytes
        ("int4 g128", (8, 64), 8 * 32 + 5 * 8),  # a group longer than a row: per channel
        ("int4 g8", (16, 3, 3, 3), 16 * 3 * 3 * 2 + 5 * 16 * 4),  # K = 27: 4 groups
        ("int8 g128", (8,), 8 + 5),  # 1-D: per tensor
        ("uint4 tensor", (), 1 + 5),
    ],
    ids=["int8-channel", "int8-1d", "int4-groups", "int4-odd", "group>row", "conv", "1d", "0d"],
)
def test_bytes_per_tensor(label: str, shape: tuple[int, ...], expected: int) -> None:
    assert bytes_per_tensor(parse_spec_label(label), shape) == expected


@pytest.mark.parametrize("k", [130, 384, 1536, 4096, 11008])
def test_default_ladder_is_cheapest_first_for_weights(k: int) -> None:
    shape = (64, k)
    assert candidates(DEFAULT_LADDER, shape) == DEFAULT_LADDER
    sizes = [bytes_per_tensor(s, shape) for s in DEFAULT_LADDER]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((8, 32), ["int4 channel mse", "int8 channel"]),  # groups as long as rows: repeats
        ((8, 64), ["int4 channel mse", "int4 g32 mse", "int8 channel"]),
        ((128,), ["int4 tensor mse", "int8 tensor"]),
    ],
    ids=["k32", "k64", "1d"],
)
def test_candidates_are_fitted_and_repeats_dropped(
    shape: tuple[int, ...], expected: list[str]
) -> None:
    assert labels(candidates(DEFAULT_LADDER, shape)) == expected


def test_order_follows_the_bytes_of_each_shape() -> None:
    ladder = specs("int8", "int4 g8")
    assert labels(candidates(ladder, (16, 4))) == ["int4 channel", "int8 channel"]  # 2+5 < 4+5
    assert labels(candidates(ladder, (16, 1024))) == ["int8 channel", "int4 g8"]  # 1029 < 1152
    same = specs("asym int4 g32", "int4 g32")  # equal bytes: the ladder's order stands
    assert labels(candidates(same, (4, 256))) == ["asym int4 g32", "int4 g32"]


# -- choosing -------------------------------------------------------------------------------


def test_gaussian_passes_int4_at_a_low_target(device: str) -> None:
    # 4-bit codes over the ~2.7 sigma range of 128 Gaussian values: a step of ~0.36 sigma and
    # ~19 dB; 12 dB is met by the first, cheapest candidate.
    x = gaussian((256, 1024)).to(device)
    choice = choose(x, DEFAULT_LADDER, 12.0)
    assert choice.spec == parse_spec_label("int4 g128 mse")
    assert [t.spec for t in choice.trials] == [choice.spec]
    assert 17.0 < choice.trials[0].sqnr_db < 22.0
    assert choice.result is not None and choice.result.q.device == x.device


def test_gaussian_needs_int8_at_a_higher_target() -> None:
    choice = choose(gaussian((256, 1024)), DEFAULT_LADDER, 30.0)
    assert choice.spec == QSpec()
    assert labels([t.spec for t in choice.trials]) == [
        "int4 g128 mse",
        "int4 g32 mse",
        "int8 channel",
    ]
    assert all(t.sqnr_db < 30.0 for t in choice.trials[:2])


def test_outliers_need_int8() -> None:
    # Every group of 32 holds a +-30 outlier: 4-bit steps of 60 / 15 = 4 sigma zero the bulk
    # (~15 dB); 8-bit steps of 60 / 254 = 0.24 sigma leave ~38 dB.
    x = with_outliers(128, 1024)
    choice = choose(x, DEFAULT_LADDER, 25.0)
    assert choice.spec == QSpec()
    assert [t.sqnr_db < 20.0 for t in choice.trials] == [True, True, False]
    assert choice.reason() == f"int8 channel: {choice.trials[-1].sqnr_db:.1f} dB >= 25"


def test_outliers_stay_float_when_no_candidate_reaches_the_target() -> None:
    choice = choose(with_outliers(128, 1024), DEFAULT_LADDER, 50.0)
    assert choice.spec is None and choice.result is None
    assert len(choice.trials) == len(DEFAULT_LADDER)
    assert 30.0 < choice.best_db < 50.0
    assert choice.best_db == max(t.sqnr_db for t in choice.trials)
    assert choice.reason() == f"kept float: best {choice.best_db:.1f} dB < 50"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_choosing_leaves_the_input_untouched(dtype: torch.dtype) -> None:
    x = with_outliers(64, 256).to(dtype)
    views = {"contiguous": x, "transposed": x.t()}
    for view in views.values():
        before = view.clone()
        choose(view, DEFAULT_LADDER, 100.0)  # every candidate is tried
        assert torch.equal(view, before) and view.dtype == dtype


def test_chosen_result_is_what_the_kernel_writes_and_its_sqnr_is_real() -> None:
    x = gaussian((64, 384), seed=3)
    workspace = Workspace()
    choice = choose(x, DEFAULT_LADDER, 30.0, workspace=workspace)
    assert choice.spec is not None and choice.result is not None
    alone = quantize_with(x, choice.spec)
    assert torch.equal(choice.result.q, alone.q) and torch.equal(choice.result.scale, alone.scale)
    r = choice.result
    x_hat = dequantize(r.q, r.scale, r.zero_point, choice.spec, shape=tuple(x.shape))
    xd, ed = x.double().numpy(), (x - x_hat).double().numpy()
    expected = 10 * math.log10(float(np.sum(xd * xd)) / float(np.sum(ed * ed)))
    assert choice.trials[-1].sqnr_db == pytest.approx(expected, rel=1e-5)  # float32 sums
    assert choice.trials[-1].nbytes == bytes_per_tensor(choice.spec, (64, 384))


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 8),
    cols=st.integers(1, 300),
    target=st.floats(0.0, 60.0),
    seed=st.integers(0, 2**16),
)
def test_choice_is_the_first_candidate_meeting_the_target(
    rows: int, cols: int, target: float, seed: int
) -> None:
    x = gaussian((rows, cols), seed) * torch.rand(
        rows, 1, generator=torch.Generator().manual_seed(seed)
    )
    choice = choose(x, DEFAULT_LADDER, target)
    order = candidates(DEFAULT_LADDER, (rows, cols))
    db = [quantize_with(x, s).errors.sqnr_db for s in order]  # type: ignore[union-attr]
    passing = [s for s, d in zip(order, db, strict=True) if d >= target]
    assert choice.spec == (passing[0] if passing else None)
    n = len(choice.trials)
    assert [t.spec for t in choice.trials] == list(order[:n])
    assert [t.sqnr_db for t in choice.trials] == db[:n]


def test_reason_never_contradicts_the_comparison() -> None:
    int4 = parse_spec_label("int4 g128 mse")

    def reason(db: float, target: float, chosen: bool) -> str:
        return Choice(int4 if chosen else None, (Trial(int4, db, 0),), None, target).reason()

    assert reason(24.06, 24.0, True) == "int4 g128 mse: 24.1 dB >= 24"
    assert reason(22.3, 24.0, False) == "kept float: best 22.3 dB < 24"
    assert reason(23.96, 24.0, False) == "kept float: best 23.96 dB < 24"
    assert reason(24.049, 24.045, True) == "int4 g128 mse: 24.05 dB >= 24.045"
    assert reason(math.inf, 24.0, True) == "int4 g128 mse: inf dB >= 24"


def test_misuse_and_non_finite_input() -> None:
    x = gaussian((4, 64))
    with pytest.raises(ValueError, match="non-empty ladder"):
        choose(x, (), 20.0)
    with pytest.raises(ValueError, match="target"):
        choose(x, DEFAULT_LADDER, math.nan)
    x[1, 3] = math.nan
    with pytest.raises(NonFiniteInput):
        choose(x, DEFAULT_LADDER, 20.0)
