from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qtool.numerics.metrics import error_stats
from qtool.results import ErrorStats, combine


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
