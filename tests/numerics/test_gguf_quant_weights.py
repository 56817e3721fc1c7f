"""quant_weights: what llama-quantize passes ggml's quantizers from an imatrix entry."""

from __future__ import annotations

import numpy as np
import pytest

from qtool.numerics.imatrix import MatrixStats, quant_weights


def test_each_matrix_divided_by_its_own_count_and_unreached_ones_weigh_one() -> None:
    sums = np.array([[1, 2, 3, 4], [0, 0, 0, 0], [3, 3, 3, 3]], dtype=np.float32)
    stats = MatrixStats(sums, np.array([2, 0, 3], dtype=np.int64))
    qw = quant_weights(stats, 4, 3)
    assert qw.dtype == np.float32 and qw.shape == (3, 4)
    np.testing.assert_array_equal(qw, [[0.5, 1, 1.5, 2], [1, 1, 1, 1], [1, 1, 1, 1]])


def test_division_is_float32_as_llama_quantize_does() -> None:
    sums = np.array([[1.0, 2.0, 1e-3]], dtype=np.float32)
    qw = quant_weights(MatrixStats(sums, np.array([3], dtype=np.int64)), 3)
    np.testing.assert_array_equal(qw[0], sums[0] / np.float32(3))
    assert qw[0, 2] == np.float32(np.float32(1e-3) / np.float32(3))


def test_one_flat_entry_is_cut_into_expert_slices() -> None:
    """A legacy .dat holds one matrix of n_mat * k columns for a 3-D weight: llama-quantize
    takes slice e (imatrix + e * n_per_row) for expert e's rows."""
    sums = np.arange(1, 9, dtype=np.float32).reshape(1, 8)
    qw = quant_weights(MatrixStats(sums, np.array([2], dtype=np.int64)), 4, 2)
    np.testing.assert_array_equal(qw, sums.reshape(2, 4) / np.float32(2))


@pytest.mark.parametrize(("k", "n_mat"), [(3, 2), (8, 2), (0, 1), (4, 0)])
def test_sizes_that_do_not_match_the_weight_are_refused(k: int, n_mat: int) -> None:
    stats = MatrixStats(np.ones((2, 4), np.float32), np.array([1, 1], dtype=np.int64))
    with pytest.raises(ValueError, match="values|columns"):
        quant_weights(stats, k, n_mat)
