"""The reference collector of importance-matrix statistics: forward pre-hooks on a model's
Linears gather, while the context is open, per Linear the sum of x_j^2 over every input row
(float64) and the number of rows, as llama-imatrix gathers them from its matrix products.

    with ImatrixProbe(model) as probe:
        model(tokens)                               # any number of forward passes
    imatrix = probe.imatrix(chunk_size=512, datasets=("calib.txt",))

Keyed by the weight's name in the state dict (`model.layers.0.self_attn.q_proj.weight`). A
Linear called twice in a pass counts its rows twice (llama.cpp counts each product too). Unlike
llama-imatrix, batches under 16 tokens are not skipped. Whole-model and in memory: the
block-by-block pass a calibrate command needs is built on it, not here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from qtool.engine.model.hooks import Hooks
from qtool.numerics.imatrix import MAX_CHUNK_COUNT, ImportanceMatrix, MatrixStats
from qtool.numerics.imatrix_sums import column_squares


class ImatrixProbe(Hooks):
    """Pre-hooks on every nn.Linear of `model` whose module name `include` accepts (all by
    default) while the context is open; `stats()` / `imatrix()` afterwards."""

    def __init__(self, model: Any, include: Callable[[str], bool] | None = None) -> None:
        self._linears = [
            (name, m) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and (include is None or include(name))
        ]  # fmt: skip
        self._sums: dict[str, torch.Tensor] = {}
        self._rows: dict[str, int] = {}

    def _attach(self) -> list[Any]:
        return [m.register_forward_pre_hook(self._hook(name)) for name, m in self._linears]

    def _hook(self, name: str) -> Callable[[Any, tuple[Any, ...]], None]:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            sums, rows = column_squares(args[0].detach())
            if name in self._sums:
                self._sums[name] += sums
            else:
                self._sums[name] = sums
            self._rows[name] = self._rows.get(name, 0) + rows

        return hook

    def stats(self) -> dict[str, MatrixStats]:
        """Per weight that saw input, in module order: sums rounded once to float32."""
        out = {}
        for name, _ in self._linears:
            if name in self._sums:
                sums = self._sums[name].cpu().numpy().astype(np.float32)[None]  # [1, K]
                out[f"{name}.weight"] = MatrixStats(sums, np.array([self._rows[name]], np.int64))
        return out

    def imatrix(self, chunk_size: int, datasets: tuple[str, ...] = ()) -> ImportanceMatrix:
        """The statistics with how they were gathered; chunk_count = the largest count //
        chunk_size, as numerics.imatrix.merge counts it. ValueError if nothing ran."""
        stats = self.stats()
        top = max((int(s.counts[0]) for s in stats.values()), default=0)
        count = min(top // chunk_size, MAX_CHUNK_COUNT) if chunk_size > 0 else 0
        return ImportanceMatrix(stats, chunk_size, count, datasets)
