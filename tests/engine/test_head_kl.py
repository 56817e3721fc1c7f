"""engine/model/head_kl.window_kl, the one norm + head + log-softmax + KL loop of calibration's
model KL and sensitivity passes: it equals the KL computed over the whole window at once, for
every stream with its own head, over windows that are not a multiple of the chunk, with heads
wider than a slab and stored narrower than float32, and never puts more than HEAD_ROWS
positions through the head at a time (its memory bound)."""

from __future__ import annotations

import pytest
import torch

from qtool.engine.model import head_kl
from qtool.engine.model.head_kl import HEAD_ROWS, KL_ROWS, VOCAB_SLAB, window_kl
from qtool.numerics.logits import kl_divergence


class Norm(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.scale = torch.linspace(0.5, 1.5, hidden)
        self.most = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.most = max(self.most, x.shape[0])
        return x * self.scale


@pytest.mark.parametrize("scored", [1, HEAD_ROWS, 2 * HEAD_ROWS + 5])
def test_window_kl_is_the_whole_windows_kl_in_chunks(scored: int) -> None:
    torch.manual_seed(0)
    hidden, vocab = 16, 50
    ref, head = torch.randn(1, scored + 1, hidden), torch.randn(vocab, hidden)
    streams = [
        (ref + 0.1 * torch.randn_like(ref), head),
        (ref, head + 0.2 * torch.randn_like(head)),
    ]
    norm = Norm(hidden)
    got = window_kl(norm, ref, head, streams, scored)
    base = torch.log_softmax(norm(ref[0, :scored]) @ head.T, dim=-1)
    for (x, w), kl in zip(streams, got, strict=True):
        whole = kl_divergence(base, torch.log_softmax(norm(x[0, :scored]) @ w.T, dim=-1))
        assert kl == pytest.approx(float(whole.double().sum()), rel=1e-6) and kl > 0


def test_window_kl_bounds_the_rows_through_the_head() -> None:
    norm = Norm(8)
    x = torch.randn(1, 200, 8)
    window_kl(norm, x, torch.randn(30, 8), [(x, torch.randn(30, 8))] * 3, 199)
    assert norm.most == HEAD_ROWS


def test_a_bfloat16_head_in_slabs_gives_the_float32_heads_bits() -> None:
    """A head wider than VOCAB_SLAB (not a multiple of it), kept in bfloat16: each slab widened
    to float32 is exact, so every sum is the float32 head's to the bit, and the whole window's."""
    torch.manual_seed(1)
    hidden, vocab, scored = 24, 2 * VOCAB_SLAB + 7, HEAD_ROWS + 3
    narrow = torch.randn(vocab, hidden).to(torch.bfloat16)
    ref = torch.randn(1, scored + 1, hidden)
    streams = [(ref + 0.1 * torch.randn_like(ref), narrow)]
    wide = narrow.float()
    got = window_kl(Norm(hidden), ref, narrow, streams, scored)
    assert got == window_kl(Norm(hidden), ref, wide, [(streams[0][0], wide)], scored)
    base = torch.log_softmax(ref[0, :scored] * Norm(hidden).scale @ wide.T, dim=-1)
    logp = torch.log_softmax(streams[0][0][0, :scored] * Norm(hidden).scale @ wide.T, dim=-1)
    assert got[0] == pytest.approx(float(kl_divergence(base, logp).double().sum()), rel=1e-5)


@pytest.mark.parametrize("vocab", [50, VOCAB_SLAB + 3, 2 * VOCAB_SLAB + 3, 3 * VOCAB_SLAB - 5])
@pytest.mark.parametrize("rows", [1, 3, KL_ROWS + 3, HEAD_ROWS])
def test_logits_have_the_bits_of_the_whole_heads_products(vocab: int, rows: int) -> None:
    """The products in slabs, two row blocks at once, are the whole float32 head's products of
    KL_ROWS rows bit for bit (what window_kl computed before it had slabs), for vocabularies
    with a remainder of a few rows and blocks of a few rows, where MKL's narrow products round
    another way (a claim about this machine's kernels: this test is what checks it)."""
    torch.manual_seed(vocab + rows)
    hidden, narrow = torch.randn(rows, 576), (torch.randn(vocab, 576) * 0.05).to(torch.bfloat16)
    whole = narrow.float()
    want = torch.cat([hidden[c : c + KL_ROWS] @ whole.T for c in range(0, rows, KL_ROWS)])
    assert torch.equal(head_kl._logits(hidden, narrow), want)
    assert torch.equal(head_kl._logits(hidden, whole), want)
