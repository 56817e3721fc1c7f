"""The model-level figures of `qtool eval` (numerics/logits.py), the text cuts and the gates,
against straightforward references: plain Python loops in float64 over small vocabularies.
Each test names the bug it catches (a KL in the wrong direction, scoring the position that
predicts past the window, a window dropped or overlapping at a boundary)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qtool.engine.model.text import sentences, windows
from qtool.eval_results import (
    CAUSAL_LM,
    ENCODER,
    CausalFigures,
    Distribution,
    EncoderFigures,
    EvalBounds,
    EvalSummary,
    LayerRow,
    TextInfo,
    arrange_layers,
    check,
)
from qtool.numerics.logits import (
    CODE_RANGE,
    ROWS_PER_CHUNK,
    cosine,
    distribution,
    float_rows,
    kl_divergence,
    log_ratio,
    perplexity,
    score_against,
    score_window,
)


def ref_log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    total = math.log(sum(math.exp(v - top) for v in row)) + top
    return [v - total for v in row]


def ref_window(lf: torch.Tensor, lq: torch.Tensor, ids: list[int]) -> dict[str, list[float]]:
    """Position i (0 <= i < L-1) predicts ids[i + 1]: the textbook next-token loss."""
    out: dict[str, list[float]] = {"nll_f": [], "nll_q": [], "kl": [], "agree": []}
    for i in range(len(ids) - 1):
        pf = ref_log_softmax(lf[i].double().tolist())
        pq = ref_log_softmax(lq[i].double().tolist())
        out["nll_f"].append(-pf[ids[i + 1]])
        out["nll_q"].append(-pq[ids[i + 1]])
        out["kl"].append(sum(math.exp(a) * (a - b) for a, b in zip(pf, pq, strict=True)))
        out["agree"].append(float(np.argmax(pf) == np.argmax(pq)))
    return out


@pytest.mark.parametrize("length", [2, 7, ROWS_PER_CHUNK + 1, 2 * ROWS_PER_CHUNK + 5])
def test_score_window_matches_a_float64_loop(length: int) -> None:
    gen = torch.Generator().manual_seed(length)
    vocab = 11
    lf = torch.randn(length, vocab, generator=gen) * 3
    lq = lf + 0.5 * torch.randn(length, vocab, generator=gen)
    ids = torch.randint(0, vocab, (length,), generator=gen)
    got = score_window(lf, lq, ids)
    ref = ref_window(lf, lq, ids.tolist())
    assert got.kl.shape == (length - 1,)  # the last position predicts past the window
    np.testing.assert_allclose(got.nll_float, ref["nll_f"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.nll_quant, ref["nll_q"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.kl, ref["kl"], rtol=1e-4, atol=1e-6)
    assert got.agree.tolist() == [bool(a) for a in ref["agree"]]


def test_kl_is_float_relative_to_quant_not_the_reverse() -> None:
    """p = (0.9, 0.1), q = (0.5, 0.5): KL(p||q) = 0.368, KL(q||p) = 0.511 nats."""
    p, q = torch.tensor([[0.9, 0.1]]).log(), torch.tensor([[0.5, 0.5]]).log()
    forward = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert kl_divergence(p, q).item() == pytest.approx(forward, rel=1e-6)
    logits_f = torch.cat([p, p])  # a window of 2 tokens: position 0 scored
    logits_q = torch.cat([q, q])
    got = score_window(logits_f, logits_q, torch.tensor([0, 1]))
    assert got.kl.item() == pytest.approx(forward, rel=1e-6)
    assert got.kl.item() != pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1))


def test_targets_are_the_next_tokens() -> None:
    """A model certain of the next token has NLL 0 only if position i is scored on ids[i+1]."""
    ids = torch.tensor([3, 1, 4, 1, 5, 2])
    logits = torch.full((6, 8), -30.0)
    logits[torch.arange(5), ids[1:]] = 30.0  # position i puts all mass on ids[i + 1]
    got = score_window(logits, logits, ids)
    assert got.nll_float.max().item() < 1e-6
    assert perplexity(got.nll_float) == pytest.approx(1.0)
    shifted = torch.roll(logits, 1, dims=0)  # the off-by-one model: position i -> ids[i]
    assert perplexity(score_window(shifted, shifted, ids).nll_float) > 1e10


def test_identical_logits_give_exactly_zero_kl_and_full_agreement() -> None:
    logits = torch.randn(9, 5, generator=torch.Generator().manual_seed(3))
    got = score_window(logits, logits.clone(), torch.arange(9) % 5)
    assert torch.equal(got.kl, torch.zeros(8)) and bool(got.agree.all())


def test_a_token_only_the_quant_model_rules_out_gives_infinite_kl() -> None:
    lf = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    lq = torch.tensor([[0.0, -math.inf], [0.0, 0.0]])
    assert score_window(lf, lq, torch.tensor([0, 0])).kl.item() == math.inf
    assert score_window(lq, lf, torch.tensor([0, 0])).kl.item() == pytest.approx(math.log(2))


def test_score_window_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="logits"):
        score_window(torch.zeros(3, 4), torch.zeros(3, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="expected logits"):
        score_window(torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(4, dtype=torch.long))


def test_distribution_matches_numpy() -> None:
    values = torch.rand(1001, generator=torch.Generator().manual_seed(5))
    d = distribution(values)
    v = values.double().numpy()
    assert d.mean == pytest.approx(v.mean())
    assert d.median == pytest.approx(np.percentile(v, 50))
    assert d.p90 == pytest.approx(np.percentile(v, 90))
    assert d.p99 == pytest.approx(np.percentile(v, 99))
    assert d.max == v.max()


def test_cosine() -> None:
    a = torch.tensor([1.0, 2.0, 3.0])
    assert cosine(a, 2 * a) == pytest.approx(1.0)
    assert cosine(a, -a) == pytest.approx(-1.0)
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == pytest.approx(0.0)


# ---- windows and sentences ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "ctx", "expected"),
    [
        (10, 4, [(0, 4), (4, 8), (8, 10)]),  # the last, shorter window kept (2 tokens)
        (9, 4, [(0, 4), (4, 8)]),  # a last window of 1 token predicts nothing: dropped
        (8, 4, [(0, 4), (4, 8)]),
        (3, 512, [(0, 3)]),
        (1, 4, []),
    ],
    ids=["short-tail", "one-token-tail", "exact", "one-window", "too-short"],
)
def test_windows_cover_the_tokens_without_overlap(
    count: int, ctx: int, expected: list[tuple[int, int]]
) -> None:
    assert windows(count, ctx) == expected


def test_windows_score_every_token_but_each_windows_first() -> None:
    spans = windows(1001, 37)  # 27 windows of 37 and one of 2
    assert spans[0][0] == 0 and spans[-1] == (999, 1001) and len(spans) == 28
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert sum(e - s - 1 for s, e in spans) == 1001 - 28


def test_sentences_join_wrapped_lines_and_cut_after_stops() -> None:
    text = "The first one\nwraps here. Second!  Third?\n\n----\n\nA new paragraph"
    assert sentences(text) == ["The first one wraps here.", "Second!", "Third?", "A new paragraph"]


# ---- gates ----------------------------------------------------------------------------------


def summary(
    causal: CausalFigures | None = None, encoder: EncoderFigures | None = None
) -> EvalSummary:
    kind = CAUSAL_LM if causal is not None else ENCODER
    return EvalSummary(
        ("f", "q"), "test", "X", kind, TextInfo("t", 1, ""), "FLOAT's", 10, 4, 3, "float32",
        "cpu", 1, 2, causal, encoder, None, 1.0, 1.0,
    )  # fmt: skip


CAUSAL = CausalFigures(10.0, 11.0, Distribution(0.02, 0.01, 0.05, 0.1, 0.3), 95, 100)


def test_gates_name_the_broken_bound() -> None:
    s = summary(CAUSAL)
    assert check(EvalBounds(max_kl=0.02, max_ppl_ratio=1.1, min_top1=0.95), s) == []
    broken = check(EvalBounds(max_kl=0.01, max_ppl_ratio=1.05, min_top1=0.96), s)
    assert [v.bound for v in broken] == ["max_kl", "max_ppl_ratio", "min_top1"]
    assert "mean KL 0.02 is above 0.01" in broken[0].detail


def test_nan_figures_and_missing_figures_fail_their_bound() -> None:
    nan = CausalFigures(10.0, math.nan, Distribution(math.nan, 0, 0, 0, 0), 0, 100)
    assert len(check(EvalBounds(max_kl=1.0, max_ppl_ratio=2.0), summary(nan))) == 2
    broken = check(EvalBounds(min_cosine=0.9), summary(CAUSAL))
    assert broken[0].value is None and "no such figure" in broken[0].detail


@pytest.mark.parametrize("ppl_float", [math.inf, math.nan])
def test_a_figure_that_is_not_finite_fails_its_bound(ppl_float: float) -> None:
    """A gate passes only on a finite figure within the bound: an infinite float perplexity
    made the ratio 0 (and ln ratio -inf), which passed every --max-ppl-ratio."""
    broken_float = CausalFigures(ppl_float, 10.0, Distribution(-math.inf, 0, 0, 0, 0), 90, 100)
    bounds = EvalBounds(max_kl=1.0, max_ppl_ratio=2.0, min_top1=0.5)
    assert [v.bound for v in check(bounds, summary(broken_float))] == ["max_kl", "max_ppl_ratio"]


def test_bounds_are_checked_and_placed() -> None:
    with pytest.raises(ValueError, match="min_top1"):
        EvalBounds(min_top1=1.5)
    with pytest.raises(ValueError, match="max_kl"):
        EvalBounds(max_kl=math.nan)
    assert EvalBounds(max_kl=1, min_cosine=0.9).misplaced(ENCODER) == ["max_kl"]
    assert EvalBounds(max_kl=1, min_cosine=0.9).misplaced(CAUSAL_LM) == ["min_cosine"]


def test_layers_sort_worst_first_with_unreached_layers_last() -> None:
    rows = (
        LayerRow("a", (2, 2), 30.0, 25.0, 4),
        LayerRow("b", (2, 2), 20.0, 28.0, 4),
        LayerRow("c", (2, 2), 10.0, math.nan, 0),
    )
    assert [r.name for r in arrange_layers(rows, "output", None)] == ["a", "b", "c"]
    assert [r.name for r in arrange_layers(rows, "weight", 2)] == ["c", "b"]
    assert [r.name for r in arrange_layers(rows, "model", None)] == ["a", "b", "c"]


# ---- the float side kept apart; llama-perplexity's statistics --------------------------------


def random_pair(seed: int, n: int = 40, vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lf = torch.randn(n, vocab, generator=gen) * 3
    return lf, lf + 0.7 * torch.randn(n, vocab, generator=gen)


@pytest.mark.parametrize("length", [2, ROWS_PER_CHUNK + 3])
def test_float_rows_kept_apart_score_exactly_as_the_pair(length: int) -> None:
    """Scoring against the float side kept with every log-probability is the pair's scoring
    bit for bit: several candidates against one float pass report what one pair reports."""
    lf, lq = random_pair(length, length, 70)
    ids = torch.randint(0, 70, (length,), generator=torch.Generator().manual_seed(1))
    pair = score_window(lf, lq, ids)
    kept = score_against(float_rows(lf, ids), lq, ids)
    for name in ("nll_float", "nll_quant", "kl", "agree"):
        assert torch.equal(getattr(pair, name), getattr(kept, name)), name


def test_argmax_ties_take_the_lowest_id_on_both_sides() -> None:
    lf = torch.tensor([[1.0, 3.0, 3.0], [0.0, 0.0, 0.0]])
    rows = float_rows(lf, torch.tensor([0, 1]))
    assert rows.argmax.tolist() == [1]
    assert bool(score_against(rows, lf.clone(), torch.tensor([0, 1])).agree.all())


def test_coded_kl_of_a_model_against_itself_is_never_negative() -> None:
    """FLOAT against its own 16-bit codes: the rounding of the codes made some positions'
    KL slightly negative (-1e-7), which no KL is; every position is at least 0."""
    gen = torch.Generator().manual_seed(5)
    lf = torch.randn(200, 500, generator=gen) * 4
    ids = torch.randint(0, 500, (200,), generator=gen)
    kl = score_against(float_rows(lf, ids, coded=True), lf, ids).kl
    assert float(kl.min()) >= 0.0 and float(kl.max()) < 1e-3


def coded_bound(lf: torch.Tensor, lq: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """float64: the bound on |KL from codes - KL| docs/eval.md states: with d = scale / 2 (the
    rounding of each ln p_f), (e^d - 1) sum p_f |ln p_f/p_q| + e^d d, plus sum p_f |ln p_f/p_q|
    over the tokens below the coded range (dropped)."""
    f = torch.log_softmax(lf.double(), -1).numpy()
    q = torch.log_softmax(lq.double(), -1).numpy()
    d = scale.double().numpy()[:, None] / 2
    terms = np.exp(f) * np.abs(f - q)
    dropped = np.where(f < f.max(axis=1, keepdims=True) - CODE_RANGE, terms, 0.0).sum(axis=1)
    return ((np.exp(d) - 1) * terms).sum(axis=1) + (np.exp(d) * d)[:, 0] + dropped


@pytest.mark.parametrize("spread", [1.0, 3.0, 12.0], ids=["flat", "peaked", "past-the-range"])
def test_coded_log_probs_give_the_kl_within_its_stated_bound(spread: float) -> None:
    """Every float log-probability in 16 bits (llama-perplexity's --kl-divergence-base): each
    decodes within half a step (at most 24 nats / 65534 / 2) inside the range, those below it
    decode to -inf, and the KL stays within the bound docs/eval.md gives; every other figure is
    unchanged. Fails on a code off by one step, a range not anchored at the top, or a scale
    not per row."""
    gen = torch.Generator().manual_seed(int(spread))
    lf = torch.randn(40, 300, generator=gen) * spread
    lq = lf + 0.3 * torch.randn(40, 300, generator=gen)
    ids = torch.randint(0, 300, (40,), generator=gen)
    rows = float_rows(lf, ids, coded=True)
    assert rows.coded is not None and rows.coded.codes.dtype == torch.int16
    exact = float_rows(lf, ids)
    assert exact.logp is not None
    decoded = rows.coded.logp(0, 39)
    inside = exact.logp >= exact.logp.max(-1, keepdim=True).values - CODE_RANGE
    err = (decoded - exact.logp).abs()[inside]
    assert float(err.max()) <= float(rows.coded.scale.max()) / 2 + 1e-5
    assert float(rows.coded.scale.max()) <= CODE_RANGE / 65534 + 1e-9
    assert bool(torch.isinf(decoded[~inside]).all())
    if spread == 12.0:
        assert int((~inside).sum()) > 100  # the range really cuts here
    got = score_against(rows, lq, ids)
    want = score_window(lf, lq, ids)
    gap = np.abs(got.kl.double().numpy() - want.kl.double().numpy())
    assert np.all(gap <= coded_bound(lf[:-1], lq[:-1], rows.coded.scale) + 1e-6)
    for name in ("nll_float", "nll_quant", "agree"):
        assert torch.equal(getattr(got, name), getattr(want, name))


def test_log_ratio_and_dp_match_llama_perplexitys_definitions() -> None:
    """llama-perplexity: ln(PPL(Q)/PPL(base)) = mean of nll_q - nll_f, its uncertainty
    sqrt(se_q^2 + se_f^2 - 2 cov) with se = sqrt((<x^2> - <x>^2)/(n-1)) and cov =
    (<ab> - <a><b>)/(n-1); mean dp = <p_q(y) - p_f(y)>. Fails on a variance over n, on the
    difference taken the other way, or on the probabilities of the argmax instead of y."""
    gen = torch.Generator().manual_seed(9)
    nll_f = torch.rand(500, generator=gen) * 5
    nll_q = nll_f + torch.randn(500, generator=gen) * 0.3 + 0.05
    mean, se, dp = log_ratio(nll_f, nll_q)
    a, b = nll_q.double().numpy(), nll_f.double().numpy()
    n = len(a)

    def unc(x: np.ndarray) -> float:
        return math.sqrt(((x * x).mean() - x.mean() ** 2) / (n - 1))

    cov = ((a * b).mean() - a.mean() * b.mean()) / (n - 1)
    assert mean == pytest.approx(a.mean() - b.mean(), rel=1e-12)
    assert math.log(perplexity(nll_q) / perplexity(nll_f)) == pytest.approx(mean, rel=1e-9)
    assert se == pytest.approx(math.sqrt(unc(a) ** 2 + unc(b) ** 2 - 2 * cov), rel=1e-6)
    assert dp == pytest.approx(float(np.mean(np.exp(-a) - np.exp(-b))), rel=1e-9)
    assert math.isnan(log_ratio(nll_f[:1], nll_q[:1])[1])


def test_distribution_p999_matches_numpy() -> None:
    values = torch.rand(5003, generator=torch.Generator().manual_seed(6)) ** 4
    assert distribution(values).p999 == pytest.approx(np.percentile(values.double().numpy(), 99.9))


def test_a_token_the_reference_rules_out_contributes_nothing() -> None:
    """p = (1, 0): KL(p || q) = ln(1 / q_0) whatever q gives the token p rules out, and 0 where
    q rules it out too (0 x -inf is taken as 0, not NaN)."""
    lf = torch.tensor([[0.0, -math.inf], [0.0, -math.inf]])
    lq = torch.tensor([[0.5, 0.5], [0.0, -math.inf]]).log_softmax(dim=-1)
    got = kl_divergence(lf, lq)
    assert got[0].item() == pytest.approx(math.log(2)) and got[1].item() == 0.0
