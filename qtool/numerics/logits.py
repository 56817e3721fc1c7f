"""Model-level figures on logits and hidden states (no I/O): next-token log-likelihood, KL
divergence and top-1 agreement of two models on one window, cosine of pooled embeddings, and
the summary of a per-position figure.

Conventions: `logits` of a window of L tokens have shape [L, V]; the logits at position i
predict token i + 1, so a window scores positions 1..L-1 (L - 1 predictions) and never its
first token. Every figure is computed in float32 from the logits (upcast when the model ran in
bf16/fp16), sums and quantiles in float64. KL(float || quant) = sum_v p_f(v) (log p_f(v) -
log p_q(v)): the float model's distribution is the reference, as in llama.cpp's
`--kl-divergence`.

The float side can also be kept apart from its logits, as `FloatRows` (what scoring needs of
one window: the next-token NLL, the argmax, and every log-probability, in float32 or in 16 bits
like llama-perplexity's --kl-divergence-base, over 24 nats), so that one float pass serves many
quantized models (`score_against`): in float32 the figures are those of `score_window`, bit
for bit; coded, only the KL moves, within a bound docs/eval.md states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qtool.eval_results import Distribution

ROWS_PER_CHUNK = 128  # positions per step: bounds the [rows, V] temporaries (V reaches 150k)


@dataclass(frozen=True)
class WindowScores:
    """Per scored position of one window (each [L - 1])."""

    nll_float: torch.Tensor  # -log p_f(next token)
    nll_quant: torch.Tensor  # -log p_q(next token)
    kl: torch.Tensor  # KL(p_f || p_q)
    agree: torch.Tensor  # argmax p_f == argmax p_q (bool)


def score_window(
    logits_float: torch.Tensor, logits_quant: torch.Tensor, ids: torch.Tensor
) -> WindowScores:
    """The figures of one window `ids` [L] from both models' logits [L, V]: the logits at
    position i are scored against ids[i + 1]."""
    if logits_float.shape != logits_quant.shape:
        raise ValueError(f"logits differ in shape: {logits_float.shape} vs {logits_quant.shape}")
    if logits_float.dim() != 2 or logits_float.shape[0] != ids.shape[0]:
        raise ValueError(f"expected logits [{ids.shape[0]}, V], got {list(logits_float.shape)}")
    if ids.shape[0] < 2:
        raise ValueError("a window needs at least 2 tokens (one prediction)")
    targets = ids[1:].to(logits_float.device)  # [L-1]: what positions 0..L-2 predict
    scored_f, scored_q = logits_float[:-1], logits_quant[:-1]  # [L-1, V]; the last predicts
    # a token beyond the window, so it is not scored
    parts = [
        _score_rows(scored_f[r : r + ROWS_PER_CHUNK], scored_q[r : r + ROWS_PER_CHUNK],
                    targets[r : r + ROWS_PER_CHUNK])
        for r in range(0, targets.shape[0], ROWS_PER_CHUNK)
    ]  # fmt: skip
    return WindowScores(*(torch.cat([p[k] for p in parts]).cpu() for k in range(4)))


def _score_rows(
    lf: torch.Tensor, lq: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nll_f, nll_q, kl, agree) of rows that predict `targets` (rows [n, V], targets [n])."""
    if not lf.shape[0] == lq.shape[0] == targets.shape[0]:
        raise ValueError(f"{lf.shape[0]} rows of logits for {targets.shape[0]} targets")
    logp_f = torch.log_softmax(lf.float(), dim=-1)  # [n, V]
    logp_q = torch.log_softmax(lq.float(), dim=-1)
    return (
        nll(logp_f, targets),
        nll(logp_q, targets),
        kl_divergence(logp_f, logp_q),
        lf.argmax(dim=-1) == lq.argmax(dim=-1),
    )


CODE_RANGE = 24.0  # nats below each position's top log-probability that 16-bit codes cover
CODE_STEPS = 65534  # codes 1..65535 span the range; 0: below it (probability < e^-24 of the top)


@dataclass(frozen=True)
class Coded:
    """Every log-probability of n positions in 16 bits, like llama-perplexity's
    --kl-divergence-base but over 24 nats in 65,534 steps (its: 16 nats, 65,535): ln p ~
    floor + (code - 1) * scale, code 0 below floor."""

    codes: torch.Tensor  # [n, V] int16 (the uint16 code's bits)
    scale: torch.Tensor  # [n] float32: CODE_RANGE / CODE_STEPS or less
    floor: torch.Tensor  # [n] float32: the lowest log-probability coded

    def logp(self, start: int, end: int) -> torch.Tensor:
        """Rows start..end-1 decoded to float32 log-probabilities (-inf for code 0)."""
        codes = self.codes[start:end].to(torch.int32) & 0xFFFF
        values = self.floor[start:end, None] + (codes - 1).float() * self.scale[start:end, None]
        return torch.where(codes > 0, values, -math.inf)


@dataclass(frozen=True)
class FloatRows:
    """The float model at the n scored positions of one window: -log p_f(next token), its
    argmax (lowest id on a tie, as torch's), and every log-probability, in float32 or coded."""

    nll: torch.Tensor  # [n] float32
    argmax: torch.Tensor  # [n] int64
    logp: torch.Tensor | None  # [n, V] float32; None: `coded` instead
    coded: Coded | None


def float_rows(logits_float: torch.Tensor, ids: torch.Tensor, coded: bool = False) -> FloatRows:
    """The float side of one window's figures (`ids` [L], logits [L, V]): every
    log-probability in float32 (exact figures), or `coded` in 16 bits."""
    targets, scored = _scored(logits_float, ids)
    nlls, argmaxes, logps, codes = [], [], [], []
    for r in range(0, targets.shape[0], ROWS_PER_CHUNK):
        rows = scored[r : r + ROWS_PER_CHUNK]
        logp = torch.log_softmax(rows.float(), dim=-1)
        nlls.append(nll(logp, targets[r : r + ROWS_PER_CHUNK]).cpu())
        argmaxes.append(rows.argmax(dim=-1).cpu())
        if coded:
            codes.append(code_log_probs(logp.cpu()))
        else:
            logps.append(logp.cpu())
    if not coded:
        return FloatRows(torch.cat(nlls), torch.cat(argmaxes), torch.cat(logps), None)
    joined = Coded(
        *(torch.cat([getattr(c, f) for c in codes]) for f in ("codes", "scale", "floor"))
    )
    return FloatRows(torch.cat(nlls), torch.cat(argmaxes), None, joined)


def code_log_probs(logp: torch.Tensor) -> Coded:
    """Rows of log-probabilities [n, V] in 16 bits: from each row's top down to CODE_RANGE nats
    below it (or its lowest, if higher) in CODE_STEPS equal steps, rounded to the nearest."""
    top = logp.max(dim=-1).values
    low = logp.min(dim=-1).values
    floor = torch.maximum(low, top - CODE_RANGE)
    scale = (top - floor) / CODE_STEPS
    step = scale[:, None]
    steps = torch.where(step > 0, (logp - floor[:, None]) / step.clamp_min(1e-30), 0.0)
    codes = torch.where(logp >= floor[:, None], steps.round() + 1, 0.0).clamp(0, CODE_STEPS + 1)
    return Coded(codes.to(torch.int32).to(torch.int16), scale.float(), floor.float())


def score_against(
    reference: FloatRows, logits_quant: torch.Tensor, ids: torch.Tensor
) -> WindowScores:
    """The figures of one window `ids` [L] from the float side kept as `reference` and the
    quantized model's logits [L, V]."""
    targets, scored = _scored(logits_quant, ids)
    if reference.nll.shape[0] != targets.shape[0]:
        raise ValueError(f"{reference.nll.shape[0]} float rows for {targets.shape[0]} positions")
    kls, nlls, agree = [], [], []
    for r in range(0, targets.shape[0], ROWS_PER_CHUNK):
        end = r + ROWS_PER_CHUNK
        rows = scored[r:end]
        logp_q = torch.log_softmax(rows.float(), dim=-1)
        nlls.append(nll(logp_q, targets[r:end]).cpu())
        if reference.logp is not None:
            kl = kl_divergence(reference.logp[r:end].to(logp_q.device), logp_q)
        else:
            assert reference.coded is not None
            logp_f = reference.coded.logp(r, end).to(logp_q.device)
            # the codes' rounding can take a KL near 0 below it (-1e-7 for FLOAT against its
            # own file); a KL is never negative, so that part of the coding error is dropped
            kl = kl_divergence(logp_f, logp_q).clamp_min(0.0)
        kls.append(kl.cpu())
        agree.append(reference.argmax[r:end] == rows.argmax(dim=-1).cpu())
    return WindowScores(reference.nll, torch.cat(nlls), torch.cat(kls), torch.cat(agree))


def _scored(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets [L-1], the logits rows that predict them [L-1, V]) of one window."""
    if logits.dim() != 2 or logits.shape[0] != ids.shape[0]:
        raise ValueError(f"expected logits [{ids.shape[0]}, V], got {list(logits.shape)}")
    if ids.shape[0] < 2:
        raise ValueError("a window needs at least 2 tokens (one prediction)")
    return ids[1:].to(logits.device), logits[:-1]


def nll(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per row (logp [n, V] log-probabilities, targets [n] token ids)."""
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def kl_divergence(logp_ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per row, in nats: sum_v p_ref (log p_ref - log p_other); a token the
    reference gives probability 0 contributes 0, one only the other rules out gives +inf."""
    p_ref = logp_ref.exp()
    terms = (logp_ref - logp).mul_(p_ref)  # in place: two [rows, V] temporaries, not four
    terms.masked_fill_(p_ref.gt(0).logical_not_(), 0.0)  # NaN from 0 x -inf included
    return terms.sum(dim=-1)


def perplexity(nll_values: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood over every scored position."""
    return float(torch.exp(nll_values.double().mean()))


def distribution(values: torch.Tensor) -> Distribution:
    """Mean, median, p90, p99, p99.9 and max of a 1-D figure (quantiles interpolated
    linearly between the closest ranks, as numpy and llama-perplexity do)."""
    v = values.double()
    q = torch.quantile(v, torch.tensor([0.5, 0.9, 0.99, 0.999], dtype=torch.float64))
    return Distribution(
        float(v.mean()), float(q[0]), float(q[1]), float(q[2]), float(v.max()), float(q[3])
    )


def log_ratio(nll_float: torch.Tensor, nll_quant: torch.Tensor) -> tuple[float, float, float]:
    """(mean, standard error) of ln p_f(y) - ln p_q(y) over the positions, i.e. ln(PPL_q /
    PPL_f), and the mean of p_q(y) - p_f(y), as llama-perplexity's KL statistics give them
    (standard error: sqrt of the population variance over n - 1; NaN below 2 positions)."""
    d = nll_quant.double() - nll_float.double()
    n = d.shape[0]
    mean = float(d.mean()) if n else math.nan
    se = math.sqrt(max(float((d - mean).square().mean()), 0.0) / (n - 1)) if n > 1 else math.nan
    dp = float((torch.exp(-nll_quant.double()) - torch.exp(-nll_float.double())).mean())
    return mean, se, dp if n else math.nan


def mean_pooled(hidden: torch.Tensor) -> torch.Tensor:
    """The mean over tokens of a last hidden state [L, H], in float64."""
    return hidden.double().mean(dim=0)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """cos(a, b) of two vectors in float64 (1.0 for two equal nonzero vectors)."""
    a, b = a.double(), b.double()
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


def squared_sums(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(sum reference^2, sum (other - reference)^2) in float64: a relative error's parts."""
    ref = reference.double()
    return float(ref.square().sum()), float((other.double() - ref).square().sum())
