"""The passes over the text: each window (causal LM) or sentence (encoder) runs through FLOAT,
then through QUANT, and is scored before the next one, so at most one piece's outputs of each
model are held (never the whole text's logits: 4096 tokens x 150k vocabulary is 2.4 GB)."""

from __future__ import annotations

from typing import Any

import torch

from qtool.eval_results import CausalFigures, EncoderFigures
from qtool.numerics.logits import (
    FloatRows,
    WindowScores,
    cosine,
    distribution,
    float_rows,
    log_ratio,
    mean_pooled,
    perplexity,
    score_against,
    score_window,
    squared_sums,
)
from qtool.results import Progress


def causal_pass(
    models: tuple[Any, Any],
    pieces: list[list[int]],
    device: torch.device,
    progress: Progress | None,
) -> CausalFigures:
    """Perplexities, KL(float || quant) and top-1 agreement over the windows `pieces`."""
    float_model, quant_model = models
    scores: list[WindowScores] = []
    done = 0
    with torch.inference_mode():
        for piece in pieces:
            window = torch.tensor(piece, device=device)  # [L]
            logits_float = float_model(input_ids=window[None], use_cache=False).logits[0]
            logits_quant = quant_model(input_ids=window[None], use_cache=False).logits[0]
            scores.append(score_window(logits_float, logits_quant, window))
            del logits_float, logits_quant
            done += len(piece)
            if progress is not None:
                progress.advance(f"tokens {done:,}", len(piece))
    return causal_figures(scores)


def float_pass(
    model: Any,
    pieces: list[list[int]],
    device: torch.device,
    progress: Progress | None,
) -> list[FloatRows]:
    """The float model's side of every window's figures (every log-probability, float32),
    kept to score many quantized models against."""
    rows: list[FloatRows] = []
    with torch.inference_mode():
        for piece in pieces:
            window = torch.tensor(piece, device=device)
            logits = model(input_ids=window[None], use_cache=False).logits[0]
            rows.append(float_rows(logits, window))
            del logits
            if progress is not None:
                progress.advance(f"windows {len(rows):,}", len(piece))
    return rows


def scored_pass(
    model: Any,
    reference: list[FloatRows],
    pieces: list[list[int]],
    device: torch.device,
    progress: Progress | None,
) -> CausalFigures:
    """One quantized model's figures against the float side kept by `float_pass`."""
    scores: list[WindowScores] = []
    done = 0
    with torch.inference_mode():
        for piece, rows in zip(pieces, reference, strict=True):
            window = torch.tensor(piece, device=device)
            logits = model(input_ids=window[None], use_cache=False).logits[0]
            scores.append(score_against(rows, logits, window))
            del logits
            done += len(piece)
            if progress is not None:
                progress.advance(f"tokens {done:,}", len(piece))
    return causal_figures(scores)


def causal_figures(scores: list[WindowScores]) -> CausalFigures:
    nll_f, nll_q, kl, agree = (torch.cat([getattr(s, k) for s in scores]) for k in _FIELDS)
    ln_ratio, se, dp = log_ratio(nll_f, nll_q)
    return CausalFigures(
        perplexity(nll_f), perplexity(nll_q), distribution(kl), int(agree.sum()), len(kl),
        ln_ratio, se, dp,
    )  # fmt: skip


_FIELDS = ("nll_float", "nll_quant", "kl", "agree")


def encoder_pass(
    models: tuple[Any, Any],
    pieces: list[list[int]],
    device: torch.device,
    progress: Progress | None,
) -> EncoderFigures:
    """Cosine of the mean-pooled last hidden states of each sentence, and the relative error
    of the last hidden state over every token."""
    float_model, quant_model = models
    cosines: list[float] = []
    signal = error = 0.0
    with torch.inference_mode():
        for ids in pieces:
            batch = torch.tensor([ids], device=device)
            hidden_float = float_model(input_ids=batch).last_hidden_state[0]  # [L, H]
            hidden_quant = quant_model(input_ids=batch).last_hidden_state[0]
            cosines.append(cosine(mean_pooled(hidden_float), mean_pooled(hidden_quant)))
            s, e = squared_sums(hidden_float, hidden_quant)
            signal, error = signal + s, error + e
            if progress is not None:
                progress.advance(f"sentences {len(cosines):,}", len(ids))
    rel = (error / signal) ** 0.5 if signal > 0 else float("nan")
    return EncoderFigures(len(cosines), sum(cosines) / len(cosines), min(cosines), rel)
