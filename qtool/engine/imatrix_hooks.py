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

Mixture-of-experts blocks as transformers runs them (Mixtral, Qwen2-MoE, Qwen3-MoE): the router
(`mlp.gate`, a module holding an [E, H] weight, not a Linear) counts every row it is given, as a
Linear does; the experts (`mlp.experts`, 3-D `gate_up_proj` [E, 2I, H] and `down_proj`
[E, H, I]) give one entry per stacked weight, `mlp.experts.gate_proj.weight`,
`mlp.experts.up_proj.weight` and `mlp.experts.down_proj.weight` (the names gguf-py maps to
llama.cpp's `ffn_{gate,up,down}_exps`), of [E, K] sums and E counts: expert e's row sums the
squared rows routed to it (gate and up: the hidden states; down: act(gate) * up of those rows)
and its count is the number of (token, slot) routings to e, as llama-imatrix accumulates a
MUL_MAT_ID. The down inputs are recomputed from the expert's weights in the hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from qtool.engine.model.hooks import Hooks
from qtool.errors import NumericError
from qtool.numerics.imatrix import MAX_CHUNK_COUNT, ImportanceMatrix, MatrixStats
from qtool.numerics.imatrix_sums import column_squares


class ImatrixProbe(Hooks):
    """Pre-hooks on every nn.Linear, router and experts module of `model` whose module name
    `include` accepts (all by default) while the context is open; `stats()` / `imatrix()`
    afterwards."""

    def __init__(self, model: Any, include: Callable[[str], bool] | None = None) -> None:
        modules = [(n, m) for n, m in model.named_modules() if include is None or include(n)]
        self._linears = [
            (name, m) for name, m in modules if isinstance(m, torch.nn.Linear) or is_router(m)
        ]  # fmt: skip
        self._experts = [(name, m) for name, m in modules if is_experts(m)]
        self._sums: dict[str, torch.Tensor] = {}
        self._rows: dict[str, int] = {}
        self._expert_sums: dict[str, torch.Tensor] = {}  # [E, K] float64
        self._expert_rows: dict[str, torch.Tensor] = {}  # [E] int64

    def _attach(self) -> list[Any]:
        handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in self._linears]
        for name, m in self._experts:
            handles.append(m.register_forward_pre_hook(self._experts_hook(name), with_kwargs=True))
        return handles

    def _experts_hook(self, name: str) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], None]:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            routed = args[1] if len(args) > 1 else kwargs["top_k_index"]
            for stacked, (sums, rows) in expert_squares(module, x.detach(), routed).items():
                key = f"{name}.{stacked}"
                if key in self._expert_sums:
                    self._expert_sums[key] += sums
                    self._expert_rows[key] += rows
                else:
                    self._expert_sums[key], self._expert_rows[key] = sums, rows

        return hook

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
        """Per weight that saw input, in module order: sums rounded once to float32.
        NumericError naming the weight whose sums are not finite there (inputs that overflow:
        finite weights of huge magnitude; NaN weights are refused as they load)."""
        out = {}
        for name, _ in self._linears:
            if name in self._sums:
                sums = self._sums[name].cpu().numpy()[None]  # [1, K]
                rows = np.array([self._rows[name]], np.int64)
                out[f"{name}.weight"] = _checked(f"{name}.weight", sums, rows)
        for name, _ in self._experts:
            for stacked in EXPERT_ENTRIES:
                key = f"{name}.{stacked}"
                if key in self._expert_sums:
                    sums = self._expert_sums[key].cpu().numpy()
                    rows = self._expert_rows[key].cpu().numpy().astype(np.int64)
                    out[f"{key}.weight"] = _checked(f"{key}.weight", sums, rows)
        return out

    def imatrix(self, chunk_size: int, datasets: tuple[str, ...] = ()) -> ImportanceMatrix:
        """The statistics with how they were gathered; chunk_count = the largest count //
        chunk_size, as numerics.imatrix.merge counts it. ValueError if nothing ran."""
        stats = self.stats()
        top = max((int(s.counts.max()) for s in stats.values()), default=0)
        count = min(top // chunk_size, MAX_CHUNK_COUNT) if chunk_size > 0 else 0
        return ImportanceMatrix(stats, chunk_size, count, datasets)


def _checked(name: str, sums: np.ndarray, rows: np.ndarray) -> MatrixStats:
    with np.errstate(over="ignore"):  # a sum beyond float32 becomes inf, refused below
        rounded = sums.astype(np.float32)
    try:
        return MatrixStats(rounded, rows)
    except ValueError as err:
        raise NumericError(
            None, f"the squared inputs of this weight do not sum to finite float32 values "
            f"({err}): the activations reaching it overflow; fix the checkpoint", name,
        ) from None  # fmt: skip


EXPERT_ENTRIES = ("gate_proj", "up_proj", "down_proj")


def is_experts(module: Any) -> bool:
    """transformers' stacked experts (MixtralExperts, Qwen2MoeExperts, ...): 3-D gate_up_proj
    [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I], with an act_fn; not the
    transposed, interleaved or biased layouts other models' experts declare."""
    plain = {"is_transposed": False, "is_concatenated": True, "has_bias": False}
    if any(getattr(module, flag, value) != value for flag, value in plain.items()):
        return False
    gate_up, down = (getattr(module, n, None) for n in ("gate_up_proj", "down_proj"))
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return False
    if gate_up.ndim != 3 or down.ndim != 3 or not callable(getattr(module, "act_fn", None)):
        return False
    e, two_i, h = gate_up.shape
    return tuple(down.shape) == (e, h, two_i // 2) and two_i % 2 == 0


def is_router(module: Any) -> bool:
    """A mixture-of-experts router that is not a Linear (transformers' *TopKRouter): an
    [E, H] weight, no other parameter, applied to the hidden states as a Linear is."""
    weight = getattr(module, "weight", None)
    own = [n for n, _ in module.named_parameters(recurse=False)]
    return (
        type(module).__name__.endswith("Router") and own == ["weight"]
        and isinstance(weight, torch.Tensor) and weight.ndim == 2
    )  # fmt: skip


def expert_squares(
    experts: Any, x: torch.Tensor, routed: torch.Tensor
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per stacked weight of `experts` (EXPERT_ENTRIES), the sums of squared inputs of each
    expert, [E, K] float64, and its rows, [E] int64, for hidden states `x` [..., H] routed by
    `routed` [tokens, top_k] (expert ids; one out of range, as transformers pads with, routes
    nowhere)."""
    gate_up = experts.gate_up_proj
    n_experts, two_i, hidden = gate_up.shape
    rows = x.reshape(-1, hidden)
    ids = routed.reshape(rows.shape[0], -1)
    dev = rows.device
    inputs = torch.zeros(n_experts, hidden, dtype=torch.float64, device=dev)
    downs = torch.zeros(n_experts, two_i // 2, dtype=torch.float64, device=dev)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev)
    for e in range(n_experts):
        token, _ = torch.where(ids == e)  # a token once per slot routing it to e
        if not token.numel():
            continue
        mine = rows[token]
        inputs[e], counts[e] = column_squares(mine)
        gate, up = torch.nn.functional.linear(mine, gate_up[e]).chunk(2, dim=-1)
        downs[e] = column_squares(experts.act_fn(gate) * up)[0]
    return {
        "gate_proj": (inputs, counts),
        "up_proj": (inputs.clone(), counts.clone()),
        "down_proj": (downs, counts.clone()),
    }
