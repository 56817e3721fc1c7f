"""Which weights QUANT changed, and per quantized Linear the SQNR of its weight next to the
SQNR of its output on the float model's own inputs, captured by forward hooks during the float
pass (no extra pass):

    output SQNR = 10 log10( sum |X W^T|^2 / sum |X (W - W_q)^T|^2 )

X is what the Linear receives in the float model, W its float weight, W_q QUANT's. X W^T is the
hook's output less the bias; X (W - W_q)^T costs one more matmul per Linear and window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from qtool.engine.model.hooks import Hooks
from qtool.eval_results import LayerRow
from qtool.results import sqnr_db


@torch.no_grad()
def changed_parameters(float_model: Any, quant_model: Any) -> tuple[int, int]:
    """(parameters of FLOAT whose values differ in QUANT, parameters of FLOAT)."""
    theirs = dict(quant_model.named_parameters())
    ours = dict(float_model.named_parameters())
    changed = sum(
        1 for name, p in ours.items() if name not in theirs or not torch.equal(p, theirs[name])
    )
    return changed, len(ours)


@torch.no_grad()
def quantized_linears(float_model: Any, quant_model: Any) -> list[tuple[str, Any, Any]]:
    """(name, FLOAT's module, QUANT's module) of every Linear whose weight differs."""
    out = []
    for name, module in float_model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        other = quant_model.get_submodule(name)
        if not torch.equal(module.weight, other.weight):
            out.append((name, module, other))
    return out


@dataclass
class _Sums:
    signal: float = 0.0  # sum |X W^T|^2
    error: float = 0.0  # sum |X (W - W_q)^T|^2
    tokens: int = 0


@dataclass
class LayerProbe(Hooks):
    """Hooks on FLOAT's quantized Linears while the context is open; `rows()` afterwards."""

    float_model: Any
    quant_model: Any
    _layers: list[tuple[str, Any, Any]] = field(default_factory=list)
    _sums: dict[str, _Sums] = field(default_factory=dict)

    def _attach(self) -> list[Any]:
        self._layers = quantized_linears(self.float_model, self.quant_model)
        self._sums = {name: _Sums() for name, _, _ in self._layers}
        return [m.register_forward_hook(self._hook(name, o)) for name, m, o in self._layers]

    def _hook(self, name: str, other: Any) -> Any:
        sums = self._sums[name]

        def hook(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> None:
            x = args[0]  # [..., K]
            y = output if module.bias is None else output - module.bias  # X W^T, [..., N]
            delta = module.weight.float() - other.weight.float()  # in float32 whatever the dtype
            e = F.linear(x.float(), delta)  # X (W - W_q)^T, [..., N]
            sums.signal += float(y.float().square().sum(dtype=torch.float64))
            sums.error += float(e.float().square().sum(dtype=torch.float64))
            sums.tokens += x.numel() // x.shape[-1]

        return hook

    @torch.no_grad()
    def rows(self) -> tuple[LayerRow, ...]:
        """One row per quantized Linear, in module order."""
        out = []
        for name, module, other in self._layers:
            w, dw = module.weight.float(), (module.weight.float() - other.weight.float())
            weight_db = sqnr_db(float(w.square().sum(dtype=torch.float64)),
                                float(dw.square().sum(dtype=torch.float64)))  # fmt: skip
            s = self._sums[name]
            output_db = sqnr_db(s.signal, s.error) if s.tokens else float("nan")
            out.append(LayerRow(name, tuple(module.weight.shape), weight_db, output_db, s.tokens))
        return tuple(out)
