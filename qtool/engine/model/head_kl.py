"""The last step of every block-by-block KL: final norm, head, log-softmax and KL(reference ||
stream) per scored position, a few positions at a time (calibration's model KL and sensitivity
passes; eval runs whole models and scores through numerics.logits)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from qtool.numerics.logits import kl_divergence

HEAD_ROWS = 64
"""Positions through the head's product at a time: the reference's and one stream's [rows,
vocabulary] float32 buffers are held at once. MKL packs the head again for every product, so
fewer, taller products cost less (SmolLM2's head, 512 positions on one thread: 0.61 s in
products of 32 rows, 0.43 s of 64 in slabs); the buffers grow with it (2 x 12.6 MB at 64)."""

KL_ROWS = 32
"""Positions whose log-softmax and KL temporaries are alive at once (SmolLM2, three streams:
the head phase raised the peak resident set by 419 MiB with 128 rows, 166 MiB with 32, the
head's own 108 MiB included). The KL sums are taken over these chunks in this order."""

VOCAB_SLAB = 1024
"""Rows of the head multiplied at a time: the slab (converted to float32 if stored narrower,
which is exact) and its product stay in cache. Each logit is the same dot product over the
same hidden values whatever the slab, so the bits are those of the whole product."""


def window_kl(
    norm: Callable[[torch.Tensor], torch.Tensor],
    ref: torch.Tensor,
    head: torch.Tensor,
    streams: Sequence[tuple[torch.Tensor, torch.Tensor]],
    scored: int,
) -> list[float]:
    """For each (hidden states, head weight) of `streams`, the sum over positions 0..scored-1 of
    KL(reference || stream), the reference being `ref`'s states through `head`; states
    [1, L, hidden] float32, head weights [vocabulary, hidden] in any floating dtype float32
    holds exactly (a bfloat16 head is not widened whole). The reference's log-probabilities
    are computed once per HEAD_ROWS rows."""
    sums = [0.0] * len(streams)
    with torch.no_grad():
        for r in range(0, scored, HEAD_ROWS):
            rows = slice(r, min(r + HEAD_ROWS, scored))
            base = _log_probs(_logits(norm(ref[0, rows]), head))
            for k, (x, weight) in enumerate(streams):
                logits = _logits(norm(x[0, rows]), weight)
                for c in range(0, logits.shape[0], KL_ROWS):
                    logp = torch.log_softmax(logits[c : c + KL_ROWS], dim=-1)
                    kl = kl_divergence(base[c : c + KL_ROWS], logp)
                    sums[k] += float(kl.double().sum())
                del logits
    return sums


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden @ weight.T as float32, VOCAB_SLAB rows of the weight at a time."""
    out = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.float32, device=hidden.device)
    for v in range(0, weight.shape[0], VOCAB_SLAB):
        slab = weight[v : v + VOCAB_SLAB].float()
        out[:, v : v + slab.shape[0]] = hidden @ slab.T
    return out


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary, in place, KL_ROWS rows at a time (row by row the same
    bits as the whole)."""
    for c in range(0, logits.shape[0], KL_ROWS):
        logits[c : c + KL_ROWS] = torch.log_softmax(logits[c : c + KL_ROWS], dim=-1)
    return logits
