"""Pass 7 of the plan (engine/plan.py), --keep-nonfinite: a tensor holding NaN or Inf, which
have no integer code, is kept as it is instead of failing the run."""

from __future__ import annotations

import torch

from qtool.engine.decision import Keep, NonFiniteGuard, TensorPlan
from qtool.engine.plan import ModelPlan
from qtool.engine.shards import Shards
from qtool.io.checkpoint import Checkpoint


def guard(plan: ModelPlan, shards: Shards) -> ModelPlan:
    """Every tensor still to be quantized read once more and kept if it holds NaN/Inf (the
    error budget's tensors were checked when it measured them)."""
    out: list[TensorPlan] = []
    for shard, plans in plan.per_shard():
        ckpt = shards.checkpoint(shard)
        out += [
            _checked(ckpt, p) if p.spec is not None and not p.decision.budget else p for p in plans
        ]
    return plan.with_plans(out)


def _checked(ckpt: Checkpoint, plan: TensorPlan) -> TensorPlan:
    x = ckpt.tensor(plan.entry)
    try:
        lo, hi = torch.aminmax(x)  # no full-size temporaries; NaN/Inf show up here
        if bool(torch.isfinite(lo) & torch.isfinite(hi)):
            return plan
        return kept_nonfinite(plan, x) or plan
    finally:
        ckpt.release(plan.entry)


def kept_nonfinite(plan: TensorPlan, x: torch.Tensor) -> TensorPlan | None:
    """The plan kept as it is for the NaN/Inf values `x` holds (None: it holds none)."""
    bad = int((~torch.isfinite(x)).sum())
    if not bad:
        return None
    keep = Keep(f"{bad} NaN/Inf values (--keep-nonfinite)")
    return TensorPlan(plan.entry, plan.decision.then(keep, NonFiniteGuard(bad)))
