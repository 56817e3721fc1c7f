"""GGUF quantizers given quant_weights (llama-quantize --imatrix): the bytes of ggml's
quantize_<type>(..., quant_weights) as scripts/gguf_golden.py --imatrix recorded them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qtool.gguf_types import GGML_TYPES
from qtool.numerics import gguf as G
from qtool.numerics.gguf.qfit import mean_square
from qtool.numerics.select import Kernel

GOLDEN = np.load(Path(__file__).parents[1] / "data" / "gguf_golden_imatrix.npz")
X, QW = GOLDEN["x"], GOLDEN["qw"]  # (103, 512) rows, one importance vector per row
WEIGHTED = [*G.WEIGHTED_ROW, *G.WEIGHTED]


def _all_rows(qtype: str, device: str = "cpu") -> np.ndarray:
    """Every golden row through the block kernels at once (each row with its own weights)."""
    t = GGML_TYPES[qtype]
    x = torch.from_numpy(X).to(device)
    qw = torch.from_numpy(QW).to(device).reshape(-1, t.block_size)
    blocks = x.reshape(-1, t.block_size)
    if qtype in G.WEIGHTED_ROW:
        sigma2 = mean_square(x, 1.0).repeat_interleave(X.shape[1] // t.block_size)
        out = G.WEIGHTED_ROW[qtype][0](blocks, qw, sigma2)
    else:
        out = G.WEIGHTED[qtype][0](blocks, qw)
    return out.reshape(X.shape[0], -1).cpu().numpy()


@pytest.mark.parametrize("qtype", WEIGHTED)
def test_every_type_is_byte_identical_to_ggml_with_quant_weights(qtype: str, device: str) -> None:
    bad = np.nonzero((_all_rows(qtype, device) != GOLDEN[qtype.lower()]).any(axis=1))[0]
    assert bad.tolist() == []


@pytest.mark.parametrize("qtype", WEIGHTED)
def test_quantize_with_quant_weights_takes_the_weighted_path(qtype: str) -> None:
    """The public entry, row by row (rows 9.. are Gaussian, uniform, heavy-tailed)."""
    for r in (0, 3, 9, 40, 70, 102):
        x, qw = torch.from_numpy(X[r]), torch.from_numpy(QW[r])
        ours = G.quantize(x, qtype, quant_weights=qw, kernel=Kernel.TORCH).numpy()
        assert ours.tobytes() == GOLDEN[qtype.lower()][r].tobytes(), f"row {r}"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "Q3_K", "Q4_K"])
def test_rows_in_several_chunks_give_each_rows_bytes(
    qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows are cut into chunks of whole rows (legacy types weigh by each row's mean square)."""
    table = G.WEIGHTED_ROW if qtype in G.WEIGHTED_ROW else G.WEIGHTED
    monkeypatch.setitem(table, qtype, (table[qtype][0], 1))  # one row per chunk at most
    qw = torch.from_numpy(QW[40])
    x = torch.from_numpy(X[36:48]).reshape(3, 4, 512)
    ours = G.quantize(x, qtype, quant_weights=qw, kernel=Kernel.TORCH)
    assert ours.shape == (3, 4, GGML_TYPES[qtype].row_bytes(512))
    for i, row in enumerate(x.reshape(12, 512)):
        assert torch.equal(ours.reshape(12, -1)[i], G.quantize(row, qtype, quant_weights=qw))


@pytest.mark.parametrize("qtype", WEIGHTED)
def test_weights_change_the_bytes_and_the_reference_path_is_kept_without(qtype: str) -> None:
    """With weights it is another algorithm than quantize_row_*_ref, even with all ones."""
    x = torch.from_numpy(X[20:60])
    ones = torch.ones(512)
    with_ones = G.quantize(x, qtype, quant_weights=ones)
    assert not torch.equal(with_ones, G.quantize(x, qtype))


@pytest.mark.parametrize("qtype", ["Q8_0", "F16", "BF16", "F32"])
def test_types_ggml_quantizes_without_weights_ignore_them(qtype: str) -> None:
    x = torch.from_numpy(X[20:30])
    qw = torch.from_numpy(QW[20])
    assert torch.equal(G.quantize(x, qtype, quant_weights=qw), G.quantize(x, qtype))


@pytest.mark.parametrize(
    "qw",
    [torch.ones(256), torch.ones(2, 512), torch.full((512,), -1.0), torch.full((512,), torch.nan)],
)
def test_weights_of_another_shape_negative_or_not_finite_are_a_value_error(
    qw: torch.Tensor,
) -> None:
    with pytest.raises(ValueError, match="quant_weights must be"):
        G.quantize(torch.zeros(2, 512), "Q4_K", quant_weights=qw)


@pytest.mark.parametrize("qtype", WEIGHTED)
def test_the_fused_kernels_give_the_c_bytes(qtype: str) -> None:
    pytest.importorskip("numba")
    x, qw = torch.from_numpy(X), torch.from_numpy(QW)
    ours = np.stack(
        [G.quantize(x[r], qtype, quant_weights=qw[r], kernel=Kernel.FUSED).numpy()
         for r in range(len(X))]
    )  # fmt: skip
    bad = np.nonzero((ours != GOLDEN[qtype.lower()]).any(axis=1))[0]
    assert bad.tolist() == []


@pytest.mark.parametrize("qtype", WEIGHTED)
def test_fused_and_torch_kernels_agree_on_other_rows_and_weights(qtype: str) -> None:
    """Rows of 768 (3 super-blocks, 24 legacy blocks) with weights of every magnitude."""
    pytest.importorskip("numba")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 768, generator=g) * torch.logspace(-3, 2, 16)[:, None]
    for qw in (torch.rand(768, generator=g) ** 4, torch.exp(torch.randn(768, generator=g) * 3)):
        fused = G.quantize(x, qtype, quant_weights=qw, kernel=Kernel.FUSED)
        assert torch.equal(fused, G.quantize(x, qtype, quant_weights=qw, kernel=Kernel.TORCH))


def test_quantize_tensor_gives_each_expert_its_own_weights() -> None:
    """A 3-D weight of stacked experts: matrix e's rows take row e of the weights, as
    llama-quantize's imatrix + (row / nrows_per_expert) * n_per_row."""
    from qtool.numerics.gguf.tensor import quantize_tensor
    from qtool.spec import gguf_spec

    x = torch.from_numpy(X[20:32]).reshape(2, 6, 512)
    qw = torch.from_numpy(QW[40:42])
    got = quantize_tensor(x, gguf_spec("Q4_K"), quant_weights=qw, with_errors=False).q
    for e in range(2):
        want = G.quantize(x[e], "Q4_K", quant_weights=qw[e])
        assert torch.equal(got[6 * e : 6 * e + 6], want)
    flat = quantize_tensor(x[0], gguf_spec("Q4_K"), quant_weights=qw[0], with_errors=False).q
    assert torch.equal(flat, got[:6])
    with pytest.raises(ValueError, match="do not split"):
        quantize_tensor(x[0, :5], gguf_spec("Q4_K"), quant_weights=qw)
