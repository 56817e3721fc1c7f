"""Mixture-of-experts weights as transformers holds them once loaded, and as checkpoints store
them: the router `mlp.gate` (Mixtral's checkpoints: `block_sparse_moe.gate`), the experts
stacked in 3-D `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
`mlp.experts.down_proj` [E, H, I], which checkpoints store one Linear per expert (Mixtral's
`block_sparse_moe.experts.E.w1/w3/w2`, Qwen MoE's `mlp.experts.E.gate_proj/up_proj/down_proj`:
transformers' conversion_mapping.py for mixtral and qwen2_moe fuses them on load).

    router_name("model.layers.0.mlp.gate.weight", names)      # "...block_sparse_moe.gate.weight"
    stacked_experts("model.layers.0.mlp.experts.down_proj", (4, 64, 96), names)
    # [("model.layers.0.block_sparse_moe.experts.0.w2.weight",), ... one tuple per expert]
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

import torch

_MOE_DIRS = (".mlp.", ".block_sparse_moe.")
_ROUTER = re.compile(r"(.*)\.mlp\.gate\.weight")
_STACKED = re.compile(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)")
_EXPERT_LINEARS = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
}


def router_name(name: str, names: Collection[str]) -> str | None:
    """The checkpoint's name of the router `name` where it stores it under another (Mixtral's
    `block_sparse_moe.gate.weight`), else None."""
    found = _ROUTER.fullmatch(name)
    renamed = [f"{found.group(1)}{moe}gate.weight" for moe in _MOE_DIRS] if found else []
    return next((n for n in renamed if n in names), None)


def stacked_experts(
    name: str, shape: tuple[int, ...], names: Collection[str]
) -> list[tuple[str, ...]] | None:
    """For stacked experts `name` of `shape` [E, ...], the checkpoint's tensors they are made
    of: per expert, the names of its Linears, whose rows concatenated make its matrix; None if
    the checkpoint holds no such tensors."""
    found = _STACKED.fullmatch(name)
    if found is None or not shape:
        return None
    head, stacked = found.groups()
    for moe in _MOE_DIRS:
        for linears in _EXPERT_LINEARS[stacked]:
            parts = [
                tuple(f"{head}{moe}experts.{e}.{linear}.weight" for linear in linears)
                for e in range(shape[0])
            ]
            if all(n in names for row in parts for n in row):
                return parts
    return None


def expert_linear_shape(shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
    """The shape config.json implies for each of an expert's `parts` Linears, whose rows
    concatenated make one expert's matrix of the stacked weight of `shape` [E, rows, cols]."""
    return (shape[1] // parts, *shape[2:])


ROUTED_KEY = "num_experts_per_tok"
EXPERT_KEYS = ("num_local_experts", "num_experts")


def routing_problem(config: Any) -> str | None:
    """What is wrong with the experts each token is routed to, `num_experts_per_tok` of a
    mixture-of-experts config (an object with the config.json keys as attributes), or None: it
    must be a whole number from 1 to the experts (0 routed every token to none, silently; more
    than the experts, or negative, crashed the router's top-k)."""
    counts = [getattr(config, key, None) for key in EXPERT_KEYS]
    experts = next((v for v in counts if isinstance(v, int) and _whole(v) and v > 0), None)
    routed = getattr(config, ROUTED_KEY, None)
    if experts is None or routed is None:
        return None
    if not _whole(routed) or not 1 <= routed <= experts:
        return (
            f"{ROUTED_KEY} is {routed!r}, but each token must be routed to 1 to {experts} "
            f"experts (the model has {experts}); fix it in config.json"
        )
    return None


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def stored_apart(model_state: Mapping[str, torch.Tensor], names: Collection[str]) -> set[str]:
    """The checkpoint's tensors (of `names`) that the model's routers and stacked experts
    (of `model_state`, meta tensors will do) are loaded from, where it stores them apart."""
    out: set[str] = set()
    for name, t in model_state.items():
        if name in names:
            continue
        router = router_name(name, names)
        if router is not None:
            out.add(router)
        for row in stacked_experts(name, tuple(t.shape), names) or ():
            out.update(row)
    return out
