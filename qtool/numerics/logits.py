"""Model-level figures on logits and hidden states (no I/O): next-token log-likelihood, KL
divergence and top-1 agreement of two models on one window, cosine of pooled embeddings, and
the summary of a per-position figure.

Conventions: `logits` of a window of L tokens have shape [L, V]; the logits at position i
predict token i + 1, so a window scores positions 1..L-1 (L - 1 predictions) and never its
first token. Every figure is computed in float32 from the logits (upcast when the model ran in
bf16/fp16), sums and quantiles in float64. KL(float || quant) = sum_v p_f(v) (log p_f(v) -
log p_q(v)): the float model's distribution is the reference, as in llama.cpp's
`--kl-divergence`.
"""

from __future__ import annotations

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


def nll(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per row (logp [n, V] log-probabilities, targets [n] token ids)."""
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def kl_divergence(logp_ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per row, in nats: sum_v p_ref (log p_ref - log p_other); a token the
    reference gives probability 0 contributes 0, one only the other rules out gives +inf."""
    p_ref = logp_ref.exp()
    terms = torch.where(p_ref > 0, p_ref * (logp_ref - logp), 0.0)
    return terms.sum(dim=-1)


def perplexity(nll_values: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood over every scored position."""
    return float(torch.exp(nll_values.double().mean()))


def distribution(values: torch.Tensor) -> Distribution:
    """Mean, median, p90, p99 and max of a 1-D figure (quantiles interpolated linearly)."""
    v = values.double()
    q = torch.quantile(v, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return Distribution(float(v.mean()), float(q[0]), float(q[1]), float(q[2]), float(v.max()))


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
