"""The last step of every block-by-block KL: final norm, head, log-softmax and KL(reference ||
stream) per scored position, a few positions at a time (calibration's model KL and sensitivity
passes; eval runs whole models and scores through numerics.logits)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from qtool.numerics.logits import kl_divergence

KL_ROWS = 32
"""Positions whose log-softmax and KL temporaries are alive at once (SmolLM2, three streams:
the head phase raised the peak resident set by 419 MiB with 128 rows, 166 MiB with 32, the
head's own 108 MiB included). The KL sums are taken over these chunks in this order, and on
any device but the CPU the products too (the bits a device's kernels give depend on shapes)."""

HEAD_ROWS = 2 * KL_ROWS
"""Positions through the head's product at a time on the CPU: MKL packs the head again for
every product, so fewer, taller products cost less (SmolLM2's head, 512 positions on one
thread: 0.61 s in products of 32 rows, 0.43 s of 64 in slabs); the reference's and one
stream's [rows, vocabulary] float32 buffers are held at once (2 x 12.6 MB at 64)."""

VOCAB_SLAB = 1024
"""Rows of the head multiplied at a time on the CPU: the slab (widened to float32 if stored
narrower, which is exact) and its product stay in cache. Each logit is then the same dot
product the whole head's product gives, bit for bit (MKL; tests/engine/test_head_kl.py), as
long as no product is narrower than a slab: the vocabulary's last slab takes its remainder."""


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
    step = HEAD_ROWS if ref.device.type == "cpu" else KL_ROWS
    with torch.no_grad():
        for r in range(0, scored, step):
            rows = slice(r, min(r + step, scored))
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
    """hidden @ weight.T as float32, each logit's bits those of the whole head's product in
    KL_ROWS rows: on the CPU two full KL_ROWS row blocks in one product (a block of fewer rows
    is its own: MKL rounds products of a few rows another way) and VOCAB_SLAB rows of the
    weight at a time; elsewhere the whole weight, KL_ROWS rows at a time."""
    n, vocab = hidden.shape[0], weight.shape[0]
    if hidden.device.type != "cpu":
        whole = weight.float()
        return torch.cat([hidden[c : c + KL_ROWS] @ whole.T for c in range(0, n, KL_ROWS)])
    pieces = (
        [slice(0, n)] if n == HEAD_ROWS else [slice(c, c + KL_ROWS) for c in range(0, n, KL_ROWS)]
    )
    out = torch.empty(n, vocab, dtype=torch.float32)
    v = 0
    while v < vocab:
        end = vocab if vocab - v < 2 * VOCAB_SLAB else v + VOCAB_SLAB
        slab = weight[v:end].float()
        for rows in pieces:
            out[rows, v:end] = hidden[rows] @ slab.T
        v = end
    return out


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary, in place, KL_ROWS rows at a time (row by row the same
    bits as the whole)."""
    for c in range(0, logits.shape[0], KL_ROWS):
        logits[c : c + KL_ROWS] = torch.log_softmax(logits[c : c + KL_ROWS], dim=-1)
    return logits
