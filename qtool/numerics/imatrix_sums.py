"""The importance-matrix statistics of one Linear's inputs (torch, any device): per input column
j, sum x_j^2 over the rows, and the number of rows. numerics/imatrix.py holds them as values.

    sums, rows = column_squares(x)          # x [..., K] -> sums [K] float64, rows int
"""

from __future__ import annotations

import torch

CHUNK_ROWS = 4096  # rows squared at once: a float64 copy of at most 4096 x K values


def column_squares(x: torch.Tensor, chunk_rows: int = CHUNK_ROWS) -> tuple[torch.Tensor, int]:
    """(sum over rows of x_j^2 per column, [K] float64 on x's device; the number of rows) for
    inputs x of shape [..., K], whatever x's float dtype (squared in float64)."""
    if x.ndim < 1 or not x.is_floating_point():
        raise ValueError(
            f"Linear inputs must be floating point [..., K], not {x.dtype} {list(x.shape)}"
        )
    rows = x.reshape(-1, x.shape[-1])  # [n, K]
    sums = torch.zeros(x.shape[-1], dtype=torch.float64, device=x.device)
    for start in range(0, rows.shape[0], chunk_rows):
        sums += rows[start : start + chunk_rows].double().square().sum(dim=0)
    return sums, int(rows.shape[0])
