"""Bit allocation (--target-size, --target-bpw, --target-kl): one spec per tensor from its
ladder, minimising the predicted loss within a size, or the size within a predicted loss.
No I/O: the caller measures each candidate and hands the figures in.

    up = TensorLadder("layers.0.mlp.up_proj.weight", (Candidate("int4 g64", 331776, 0.012), ...))
    plan = within_bytes([up, ...], budget_bytes, alpha)    # the least loss that fits
    plan = within_loss([up, ...], max_loss, alpha)         # the fewest bytes within the loss

Predicted loss of a plan = sum over tensors of alpha[name] * r (alpha missing: 1.0), where r is
the tensor's relative output error under the candidate (numerics.allocate.relative_error:
sum_j h_j ||dW[:, j]||^2 / sum_j h_j ||W[:, j]||^2, h_j = E[x_j^2] from an imatrix, or 1 without
one, which makes r the relative weight error 1 / 10^(SQNR/10)). With alpha measured as KL per
unit r (`qtool calibrate`'s sensitivities), the loss is a predicted KL in nats per token.

The solver is a knapsack by dynamic programming over the bytes each candidate takes above its
tensor's cheapest, counted in units of `granularity` bytes and rounded up (the cheapest plan is
always exact): every plan it returns fits its budget counted exactly, and its loss is at most
the least loss of any plan within budget - N x granularity (N tensors); granularity 1 is exact.
Ties go to the fewer bytes, then the earlier candidate (ladders sorted by bytes, then label),
so the same inputs give the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:
    import torch

MAX_STATES = 1 << 16  # byte units of the DP table per tensor (its resolution)
MAX_CELLS = 1 << 26  # backpointer bytes (tensors x states): 64 MiB at most
MAX_CANDIDATES = 255  # a tensor's ladder, indexed by one byte in the backpointers


@dataclass(frozen=True, order=True)
class Candidate:
    """One way to store one tensor: `label` (a spec label as recipes write it, e.g. 'int4 g64'
    or 'Q4_K'; 'float' for kept as it is), `nbytes` exactly as the output writes it (codes,
    scales, zero points) and `r`, its relative output error (0 for float)."""

    label: str
    nbytes: int
    r: float

    def __post_init__(self) -> None:
        if self.nbytes < 0 or not math.isfinite(self.r) or self.r < 0:
            raise ValueError(f"candidate {self.label}: bytes {self.nbytes}, r {self.r}")


@dataclass(frozen=True)
class TensorLadder:
    """A tensor's candidates (at least one), by the tensor's checkpoint name."""

    name: str
    candidates: tuple[Candidate, ...]

    def __post_init__(self) -> None:
        if not self.candidates or len(self.candidates) > MAX_CANDIDATES:
            raise ValueError(f"{self.name}: {len(self.candidates)} candidates")

    def ordered(self) -> tuple[Candidate, ...]:
        """Cheapest first; equal bytes by label (the order ties are broken in)."""
        return tuple(sorted(self.candidates, key=lambda c: (c.nbytes, c.label, c.r)))


@dataclass(frozen=True)
class Target:
    """What the allocation aims at: `kind` 'size' (bytes), 'bpw' (bits per weight over every
    tensor written) or 'kl' (predicted loss); `value` > 0 (size: an integer of bytes)."""

    kind: str
    value: float
    MAX_BPW: ClassVar[float] = 64.0  # no tensor stores more bits per value (float64 kept)

    def __post_init__(self) -> None:
        if (
            self.kind not in ("size", "bpw", "kl")
            or not (self.value > 0 and math.isfinite(self.value))
            or (self.kind == "bpw" and self.value > self.MAX_BPW)
        ):
            raise ValueError(f"target {self.kind} {self.value}")

    def describe(self) -> str:
        """'size 100 MiB (104857600 bytes)', 'bpw 4.5', 'kl 0.05'."""
        if self.kind == "size":
            return f"size {human_bytes(self.value)}"
        return f"{self.kind} {self.value:g}"

    def bytes_for(self, elements: int) -> int:
        """The byte budget of a size or bpw target for a model of `elements` values."""
        if self.kind == "size":
            return int(self.value)
        assert self.kind == "bpw"
        return math.floor(self.value * elements / 8)


def human_bytes(n: float) -> str:
    """1234567 -> '1.18 MiB (1234567 bytes)'; under 1 KiB just the bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({int(n)} bytes)"
    return f"{int(n)} bytes"


Alpha = Mapping[str, float]
"""Sensitivity per tensor name: predicted loss per unit relative output error (KL nats per
token per unit r when measured by `qtool calibrate`); a name not in it weighs 1.0."""


@dataclass(frozen=True)
class Plan:
    """The allocation: one candidate per tensor in the ladders' order, with its total bytes
    (exact) and predicted loss (summed in that order), and the solver's resolution."""

    names: tuple[str, ...]
    chosen: tuple[Candidate, ...]
    nbytes: int
    loss: float
    granularity: int

    def by_label(self) -> dict[str, tuple[int, int]]:
        """label -> (tensors, bytes), labels sorted."""
        out: dict[str, tuple[int, int]] = {}
        for c in sorted(self.chosen):
            n, b = out.get(c.label, (0, 0))
            out[c.label] = (n + 1, b + c.nbytes)
        return out


class Infeasible(ValueError):
    """No plan meets the target; `least` is the smallest size (or loss) any plan reaches."""

    def __init__(self, least: float) -> None:
        super().__init__(f"the least any plan reaches is {least:g}")
        self.least = least


def relative_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor | None = None) -> float:
    """r = sum_j h_j ||dW[:, j]||^2 / sum_j h_j ||W[:, j]||^2 for a [C, K] weight (dW = w_hat - w,
    in float64), h [K] the imatrix's E[x_j^2] (None: 1 for every column, the relative weight
    error). 0 for a zero weight quantized exactly, inf for a zero weight that is not."""
    import torch

    x = w.to(torch.float64).reshape(-1, w.shape[-1])
    d = w_hat.to(torch.float64).reshape(-1, w.shape[-1]) - x
    err, sig = (d * d).sum(dim=0), (x * x).sum(dim=0)
    if h is not None:
        hh = h.to(torch.float64).reshape(-1)
        err, sig = (hh * err), (hh * sig)
    e, s = float(err.sum()), float(sig.sum())
    if s == 0.0:
        return 0.0 if e == 0.0 else math.inf
    return e / s


def weight(alpha: Alpha | None, name: str) -> float:
    return 1.0 if alpha is None else float(alpha.get(name, 1.0))


def plan_loss(
    ladders: Sequence[TensorLadder], chosen: Sequence[Candidate], alpha: Alpha | None
) -> float:
    """sum alpha * r, in the ladders' order (the sum the solver reports)."""
    total = 0.0
    for ladder, c in zip(ladders, chosen, strict=True):
        total += weight(alpha, ladder.name) * c.r
    return total


def granularity_for(ladders: Sequence[TensorLadder], limit_bytes: int) -> int:
    """The finest unit of bytes whose table fits MAX_STATES and MAX_CELLS for `limit_bytes`."""
    states = max(1, min(MAX_STATES, MAX_CELLS // max(1, len(ladders))) - 1)
    return max(1, -(-limit_bytes // states))


def within_bytes(
    ladders: Sequence[TensorLadder],
    budget: int,
    alpha: Alpha | None = None,
    granularity: int | None = None,
) -> Plan:
    """The plan of least predicted loss whose bytes are <= budget (ties: fewer bytes).
    Infeasible (least = the cheapest plan's bytes) when even that does not fit (at a
    granularity g > 1: when it does not fit with each tensor rounded up to units of g)."""
    least = sum(ladder.ordered()[0].nbytes for ladder in ladders)
    if least > budget:
        raise Infeasible(least)
    g = granularity or granularity_for(ladders, budget - least)
    table = _Table(ladders, alpha, g, (budget - least) // g)
    finite = np.flatnonzero(np.isfinite(table.loss))
    if finite.size == 0:  # fits counted exactly, not with each tensor rounded up to units of g
        raise Infeasible(least)
    best = finite[np.argmin(table.loss[finite])]
    return table.plan(int(best))


def within_loss(
    ladders: Sequence[TensorLadder],
    max_loss: float,
    alpha: Alpha | None = None,
    granularity: int | None = None,
) -> Plan:
    """The plan of fewest bytes whose predicted loss is <= max_loss (ties: less loss).
    Infeasible (least = the least loss reachable) when none is."""
    ordered = [ladder.ordered() for ladder in ladders]
    floor = plan_loss(ladders, [min(o, key=lambda c: c.r) for o in ordered], alpha)
    if floor > max_loss:
        raise Infeasible(floor)
    excess = [max(c.nbytes for c in o) - o[0].nbytes for o in ordered]
    g = granularity or granularity_for(ladders, sum(excess))
    limit = min(MAX_STATES, MAX_CELLS // max(1, len(ladders))) - 1
    while granularity is None and sum(-(-e // g) for e in excess) > limit:
        if g > max(excess):  # every tensor with a choice needs a unit: more than the table holds
            raise ValueError(f"{len(ladders)} tensors are more than the table's {limit} units")
        g *= 2
    table = _Table(ladders, alpha, g, sum(-(-e // g) for e in excess))
    within = np.flatnonzero(table.loss <= max_loss)
    # the fewest units; among plans of the same units the DP kept the least loss for each
    return table.plan(int(within[0]))


class _Table:
    """loss[s] = the least predicted loss of a plan whose bytes above the cheapest plan's, each
    candidate's excess over its tensor's cheapest rounded up to units of g, sum to exactly s
    units (inf: none), and one byte per tensor and state saying which candidate reached it.
    Counting the excess keeps the cheapest plan at state 0, exact, however coarse g is."""

    def __init__(
        self, ladders: Sequence[TensorLadder], alpha: Alpha | None, g: int, states: int
    ) -> None:
        self.ladders, self.alpha, self.g = ladders, alpha, g
        self.ordered = [ladder.ordered() for ladder in ladders]
        loss = np.full(states + 1, np.inf)
        loss[0] = 0.0
        self.back = np.zeros((len(ladders), states + 1), dtype=np.uint8)
        for i, (ladder, cands) in enumerate(zip(ladders, self.ordered, strict=True)):
            a = weight(alpha, ladder.name)
            new = np.full_like(loss, np.inf)
            for k, c in enumerate(cands):
                units = -(-(c.nbytes - cands[0].nbytes) // g)
                if units > states:
                    continue
                moved = np.full_like(loss, np.inf)
                moved[units:] = loss[: states + 1 - units] + a * c.r
                better = moved < new  # strict: an equal loss keeps the earlier candidate
                new[better] = moved[better]
                self.back[i, better] = k
            loss = new
        self.loss = loss

    def plan(self, state: int) -> Plan:
        chosen: list[Candidate] = []
        s = state
        for i in range(len(self.ladders) - 1, -1, -1):
            c = self.ordered[i][int(self.back[i, s])]
            chosen.append(c)
            s -= -(-(c.nbytes - self.ordered[i][0].nbytes) // self.g)
        assert s == 0
        chosen.reverse()
        return Plan(
            tuple(ladder.name for ladder in self.ladders),
            tuple(chosen),
            sum(c.nbytes for c in chosen),
            plan_loss(self.ladders, chosen, self.alpha),
            self.g,
        )
