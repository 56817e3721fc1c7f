"""The error budget (--target-sqnr): for one tensor, the cheapest spec of a ladder whose SQNR
meets a target. No I/O: the caller reads the tensor once and hands it in.

The ladder is fitted to the tensor's shape (recipe.fit_spec: a group at least as long as a row
is per channel, a 0-d/1-D tensor is per tensor), repeats are dropped, and the candidates are
tried in the order of the bytes they write (ties keep the ladder's order). The first whose
SQNR >= target is chosen; when none is, the tensor stays in float and the best SQNR seen says
by how much it missed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qtool.numerics.kernels import QuantizedTensor, Workspace, quantize_with
from qtool.numerics.range_methods import GridOverflow
from qtool.results import Trial
from qtool.spec import (
    Codec,
    fit_spec,
    parse_spec_label,
    spec_label,
)

DEFAULT_LADDER: tuple[Codec, ...] = tuple(
    parse_spec_label(label) for label in ("int4 g128 mse", "int4 g32 mse", "int8", "int8 g128")
)
"""Cheapest first for every [C, K] weight: 0.5 + 5/128, 0.5 + 5/32, 1 + 5/K and 1 + 5/128
bytes per element (codes, then a float32 scale and a 1-byte zero point per group)."""


QPARAM_BYTES = 5  # a float32 scale and a 1-byte zero point per group


def bytes_per_tensor(spec: Codec, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `shape` writes with `spec` (fitted to it): its codes (4-bit: packed two
    per byte along the last dimension) and QPARAM_BYTES per group; a GGUF type, its blocks
    (of the fallback type where its own do not fit the rows, as the GGUF format stores it)."""
    fitted, _ = spec.fit(shape)
    return fitted.code_nbytes(shape) + QPARAM_BYTES * fitted.qparam_groups(shape)


def candidates(ladder: Sequence[Codec], shape: tuple[int, ...]) -> tuple[Codec, ...]:
    """The ladder fitted to `shape`, without repeats, cheapest first (stable on ties)."""
    fitted = dict.fromkeys(fit_spec(spec, shape)[0] for spec in ladder)
    return tuple(sorted(fitted, key=lambda spec: bytes_per_tensor(spec, shape)))


@dataclass(frozen=True)
class Choice:
    """The budget's answer for one tensor: `spec` (None: keep in float), every trial in the
    order tried, and the chosen quantization (codes, qparams and errors) to write."""

    spec: Codec | None
    trials: tuple[Trial, ...]
    result: QuantizedTensor | None
    target_db: float

    @property
    def best_db(self) -> float:
        """The highest SQNR any candidate reached (-inf when none was tried)."""
        return max((t.sqnr_db for t in self.trials), default=-math.inf)

    def reason(self) -> str:
        """'int4 g128 mse: 24.1 dB >= 24' or 'kept float: best 22.3 dB < 24'."""
        target = f"{self.target_db:g}"
        if self.spec is None:
            return f"kept float: best {_db(self.best_db, self.target_db, False)} dB < {target}"
        db = _db(self.trials[-1].sqnr_db, self.target_db, True)
        return f"{spec_label(self.spec)}: {db} dB >= {target}"


def choose(
    x: torch.Tensor,
    ladder: Sequence[Codec],
    target_db: float,
    *,
    scale_dtype: torch.dtype = torch.float32,
    workspace: Workspace | None = None,
) -> Choice:
    """Quantize x with each candidate, cheapest first, until one reaches `target_db`; x is not
    modified. NonFiniteInput (from the kernel) for NaN/Inf; ValueError for an empty ladder, an
    empty tensor or a NaN target. The chosen result is the last computed, so its codes stay
    valid in a shared `workspace` until its next use."""
    if not ladder or math.isnan(target_db):
        raise ValueError("the budget needs a non-empty ladder and a target in dB")
    shape = tuple(x.shape)
    trials: list[Trial] = []
    for spec in candidates(ladder, shape):
        try:
            result = quantize_with(x, spec, scale_dtype=scale_dtype, workspace=workspace)
        except GridOverflow:  # its scales overflow (a GGUF type's fp16 ones): it reaches nothing
            trials.append(Trial(spec, -math.inf, bytes_per_tensor(spec, shape)))
            continue
        assert result.errors is not None
        trials.append(Trial(spec, result.errors.sqnr_db, bytes_per_tensor(spec, shape)))
        if result.errors.sqnr_db >= target_db:
            return Choice(spec, tuple(trials), result, target_db)
    return Choice(None, tuple(trials), None, target_db)


def _db(value: float, target: float, passed: bool) -> str:
    """`value` with one decimal, or as many more as it takes not to contradict the comparison
    with `target` (23.96 against 24 shows as 23.96, not 24.0)."""
    if math.isinf(value):
        return f"{value}"
    for digits in range(1, 7):
        text = f"{value:.{digits}f}"
        if (float(text) >= target) == passed:
            return text
    return repr(value)
