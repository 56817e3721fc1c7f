from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qtool.numerics.metrics import count_nonfinite, error_stats
from qtool.results import ErrorStats, combine, sqnr_db


def test_error_stats_match_a_float64_reference(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 37, generator=gen)
    x_hat = x + 1e-3 * torch.randn(1000, 37, generator=gen)
    stats = error_stats(x.to(device), x_hat.to(device), block_elems=4096)
    xs, ys = x.double().numpy(), x_hat.double().numpy()
    err = xs - ys
    assert stats.numel == x.numel()
    assert stats.mse == pytest.approx(np.mean(err**2), rel=1e-5)
    assert stats.max_abs == pytest.approx(np.abs(err).max(), rel=1e-6)
    ref_sqnr = 10 * math.log10(np.sum(xs**2) / np.sum(err**2))
    assert stats.sqnr_db == pytest.approx(ref_sqnr, abs=1e-4)


def test_exact_reconstruction_has_infinite_sqnr() -> None:
    x = torch.randn(10)
    stats = error_stats(x, x.clone())
    assert stats.sqnr_db == math.inf and stats.mse == 0.0 and stats.max_abs == 0.0


def test_combine_weights_tensors_by_their_energy() -> None:
    a = ErrorStats(numel=10, sq_error=1.0, sq_signal=100.0, max_abs=0.5)
    b = ErrorStats(numel=30, sq_error=3.0, sq_signal=900.0, max_abs=0.7)
    both = combine([a, b])
    assert both.numel == 40 and both.max_abs == 0.7
    assert both.mse == pytest.approx(0.1)
    assert both.sqnr_db == pytest.approx(10 * math.log10(1000 / 4))


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="shape"):
        error_stats(torch.zeros(2, 3), torch.zeros(3, 2))


@pytest.mark.parametrize("magnitude", [1e17, 1e20, 3e38], ids=["1e17", "1e20", "near-max"])
def test_huge_finite_values_give_finite_float64_figures(magnitude: float) -> None:
    # float32 squares overflow at 1.8e19 and float32 sums of 1e34-sized squares at ~1e4 of them.
    gen = torch.Generator().manual_seed(1)
    x = (torch.rand(4096, generator=gen) * 2 - 1) * magnitude
    x_hat = x * (1 + 1e-3 * torch.randn(4096, generator=gen)).clamp(-1, 1)
    stats = error_stats(x, x_hat)
    xs, err = x.double().numpy(), x.double().numpy() - x_hat.double().numpy()
    assert stats.finite
    assert stats.sq_signal == pytest.approx(np.sum(xs**2), rel=1e-9)
    assert stats.sq_error == pytest.approx(np.sum(err**2), rel=1e-6)
    assert stats.sqnr_db == pytest.approx(10 * math.log10(np.sum(xs**2) / np.sum(err**2)))


def test_an_overflowing_float32_difference_is_measured_in_float64() -> None:
    big = torch.finfo(torch.float32).max
    x, x_hat = torch.tensor([big, 1.0]), torch.tensor([-big, 1.0])
    stats = error_stats(x, x_hat)
    assert stats.finite and stats.max_abs == 2 * float(big)
    assert stats.sqnr_db == pytest.approx(10 * math.log10(1 / 4), abs=1e-9)


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_nonfinite_inputs_give_figures_marked_not_finite(bad: float) -> None:
    x = torch.tensor([bad, 1.0, 2.0])
    stats = error_stats(torch.ones(3), x, block_elems=1)  # NaN must survive later slabs
    assert not stats.finite
    assert count_nonfinite(x) == 1 and count_nonfinite(torch.ones(3, dtype=torch.int8)) == 0


def test_sqnr_of_an_all_zero_reference_is_minus_infinity() -> None:
    assert error_stats(torch.zeros(3), torch.ones(3)).sqnr_db == -math.inf
    assert sqnr_db(1e-320, 1e10) == -math.inf  # an underflowing ratio, not a math error
    assert math.isnan(sqnr_db(math.nan, 1.0))


def test_pooled_mse_gain_counts_min_max_tensors_at_their_own_error() -> None:
    """A recipe mixes range methods: a min-max tensor adds its error to both sides of the
    pooled gain (it would have had that error under min-max too)."""
    searched = ErrorStats(100, sq_error=0.8, sq_signal=100.0, max_abs=1.0, sq_error_minmax=1.0)
    minmax = ErrorStats(100, sq_error=0.5, sq_signal=100.0, max_abs=1.0)
    assert combine([searched, minmax]).mse_gain == pytest.approx(1.3 / 1.5 - 1.0)
    assert combine([searched]).mse_gain == pytest.approx(-0.2)
    assert combine([minmax, minmax]).mse_gain is None  # nothing searched
