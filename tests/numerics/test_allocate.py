"""numerics/allocate.py: the knapsack against brute force on small ladders, its stated gap at a
coarse granularity, its determinism, and relative_error's definition."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.numerics.allocate import (
    Candidate,
    Infeasible,
    TensorLadder,
    granularity_for,
    plan_loss,
    relative_error,
    within_bytes,
    within_loss,
)

# r values on a coarse grid, so that distinct plans often tie (the tie rules are exercised)
_cand = st.builds(
    Candidate,
    label=st.sampled_from(["int4 g32", "int4 g64", "int8", "float", "Q4_K"]),
    nbytes=st.integers(0, 60),
    r=st.integers(0, 8).map(lambda k: k / 8),
)
_ladder = st.lists(_cand, min_size=1, max_size=4, unique_by=lambda c: c.label)
_ladders = st.lists(_ladder, min_size=1, max_size=4).map(
    lambda ls: [TensorLadder(f"t{i}", tuple(c)) for i, c in enumerate(ls)]
)
_alpha = st.lists(st.integers(0, 4).map(lambda k: k / 2), min_size=4, max_size=4).map(
    lambda a: {f"t{i}": v for i, v in enumerate(a)}
)


def _plans(ladders: list[TensorLadder]) -> list[tuple[Candidate, ...]]:
    return list(itertools.product(*(ladder.candidates for ladder in ladders)))


def _bytes(plan: tuple[Candidate, ...]) -> int:
    return sum(c.nbytes for c in plan)


@settings(max_examples=300, deadline=None)
@given(_ladders, _alpha, st.integers(0, 250))
def test_within_bytes_is_the_brute_force_optimum(
    ladders: list[TensorLadder], alpha: dict[str, float], budget: int
) -> None:
    """Granularity 1: the least loss of every plan within the budget, and of those the fewest
    bytes; a budget below the cheapest plan is Infeasible naming that plan's bytes."""
    fits = [p for p in _plans(ladders) if _bytes(p) <= budget]
    if not fits:
        with pytest.raises(Infeasible) as e:
            within_bytes(ladders, budget, alpha, granularity=1)
        assert e.value.least == min(_bytes(p) for p in _plans(ladders))
        return
    best = min((plan_loss(ladders, p, alpha), _bytes(p)) for p in fits)
    plan = within_bytes(ladders, budget, alpha, granularity=1)
    assert (plan.loss, plan.nbytes) == best
    assert plan.loss == plan_loss(ladders, plan.chosen, alpha)
    assert plan.nbytes == _bytes(plan.chosen) <= budget


@settings(max_examples=300, deadline=None)
@given(_ladders, _alpha, st.integers(0, 24).map(lambda k: k / 4))
def test_within_loss_is_the_brute_force_optimum(
    ladders: list[TensorLadder], alpha: dict[str, float], max_loss: float
) -> None:
    """Granularity 1: the fewest bytes of every plan within the loss, then the least loss."""
    ok = [p for p in _plans(ladders) if plan_loss(ladders, p, alpha) <= max_loss]
    if not ok:
        with pytest.raises(Infeasible):
            within_loss(ladders, max_loss, alpha, granularity=1)
        return
    best = min((_bytes(p), plan_loss(ladders, p, alpha)) for p in ok)
    plan = within_loss(ladders, max_loss, alpha, granularity=1)
    assert (plan.nbytes, plan.loss) == best


@settings(max_examples=300, deadline=None)
@given(_ladders, _alpha, st.integers(0, 250), st.integers(2, 9))
def test_coarse_granularity_keeps_its_stated_gap(
    ladders: list[TensorLadder], alpha: dict[str, float], budget: int, g: int
) -> None:
    """At granularity g the plan still fits the exact budget, and its loss is no more than the
    best plan's within budget - N x g (the gap the module states)."""
    try:
        plan = within_bytes(ladders, budget, alpha, granularity=g)
    except Infeasible:
        # only when no plan fits budget - N x g either (rounding up costs < g a tensor)
        assert all(_bytes(p) > budget - len(ladders) * g for p in _plans(ladders))
        return
    assert plan.nbytes <= budget
    tighter = [p for p in _plans(ladders) if _bytes(p) <= budget - len(ladders) * g]
    if tighter:
        assert plan.loss <= min(plan_loss(ladders, p, alpha) for p in tighter)


@settings(max_examples=100, deadline=None)
@given(_ladders, _alpha, st.integers(0, 24).map(lambda k: k / 4), st.integers(2, 9))
def test_coarse_granularity_within_loss_gap(
    ladders: list[TensorLadder], alpha: dict[str, float], max_loss: float, g: int
) -> None:
    """within_loss at granularity g: within the loss, and at most N x g bytes over the fewest."""
    ok = [p for p in _plans(ladders) if plan_loss(ladders, p, alpha) <= max_loss]
    if not ok:
        return
    plan = within_loss(ladders, max_loss, alpha, granularity=g)
    assert plan.loss <= max_loss
    assert plan.nbytes <= min(_bytes(p) for p in ok) + len(ladders) * g


@settings(max_examples=100, deadline=None)
@given(_ladders, _alpha, st.integers(0, 250), st.randoms())
def test_the_plan_does_not_depend_on_the_candidates_order(
    ladders: list[TensorLadder], alpha: dict[str, float], budget: int, rnd: object
) -> None:
    """Ties broken by the candidates themselves (bytes, label), not by the order given."""
    import random

    assert isinstance(rnd, random.Random)
    shuffled = []
    for ladder in ladders:
        cands = list(ladder.candidates)
        rnd.shuffle(cands)
        shuffled.append(TensorLadder(ladder.name, tuple(cands)))
    try:
        a = within_bytes(ladders, budget, alpha, granularity=1)
    except Infeasible:
        return
    assert within_bytes(shuffled, budget, alpha, granularity=1) == a


def test_missing_alpha_weighs_one() -> None:
    ladders = [TensorLadder("a", (Candidate("x", 1, 0.5), Candidate("y", 2, 0.0)))]
    assert within_bytes(ladders, 1, {}).loss == 0.5
    assert within_bytes(ladders, 1, None).loss == 0.5
    assert within_bytes(ladders, 1, {"a": 3.0}).loss == 1.5


def test_granularity_bounds_the_table() -> None:
    """The table has at most MAX_STATES columns and MAX_CELLS backpointer bytes."""
    from qtool.numerics import allocate

    many = [TensorLadder(f"t{i}", (Candidate("x", 10, 0.0),)) for i in range(5000)]
    g = granularity_for(many, 10**9)
    assert 10**9 // g + 1 <= allocate.MAX_CELLS // len(many)
    assert granularity_for(many[:1], 100) == 1


def test_relative_error_weighs_columns_by_h() -> None:
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    dw = torch.tensor([[0.1, 0.0], [0.0, 0.2]], dtype=torch.float64)
    h = torch.tensor([4.0, 0.5])
    expect = (4.0 * 0.01 + 0.5 * 0.04) / (4.0 * 10 + 0.5 * 20)
    assert math.isclose(relative_error(w, w + dw, h), expect, rel_tol=1e-12)
    assert math.isclose(relative_error(w, w + dw), 0.05 / 30, rel_tol=1e-12)
    assert relative_error(torch.zeros(2, 2), torch.zeros(2, 2)) == 0.0
    assert relative_error(torch.zeros(2, 2), torch.ones(2, 2)) == math.inf
