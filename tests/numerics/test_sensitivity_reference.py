"""The reference perturbation's grid is what numerics/sensitivity.py and calibration.md say:
symmetric absmax int4 in groups of 32, 15 levels -7..7 times max|w| / 7 (not Q4_0's 16)."""

from __future__ import annotations

import torch

from qtool.numerics.sensitivity import reference_error


def test_the_reference_grid_is_symmetric_absmax_with_15_levels() -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 96, dtype=torch.float64)
    w[0, :32] = torch.linspace(-1.0, 0.5, 32, dtype=torch.float64)  # the extreme is negative
    approx = (w + reference_error(w)).reshape(8, 3, 32)
    scale = w.reshape(8, 3, 32).abs().amax(dim=-1, keepdim=True) / 7
    codes = approx / scale
    assert torch.allclose(codes, codes.round(), atol=1e-9)
    assert int(codes.round().min()) == -7 and int(codes.round().max()) == 7
    assert torch.equal(approx[0, 0, 0], w[0, 0])  # -max|w| is on the grid (Q4_0: -8 d)
