from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from qtool.numerics import awq, kernels
from qtool.spec import Granularity, PerChannel, PerGroup, PerTensor, QSpec, Scheme, StorageDtype
from tests import reference


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- statistics and the formula ----


def test_abs_mean_over_any_chunks_and_merged() -> None:
    x = _rand(50, 8, seed=0)
    m = awq.AbsMean(8)
    m.add(x[:10])
    m.add(x[10:].reshape(4, 10, 8))
    torch.testing.assert_close(m.mean, x.abs().mean(0))
    a, b = awq.AbsMean(8), awq.AbsMean(8)
    a.add(x[:7])
    b.add(x[7:])
    merged = a.merge(b)
    assert merged.rows == 50
    torch.testing.assert_close(merged.mean, x.abs().mean(0))
    with pytest.raises(ValueError, match="width 8"):
        m.add(torch.ones(3, 4))
    with pytest.raises(ValueError, match="no input rows"):
        _ = awq.AbsMean(3).mean


@pytest.mark.parametrize(
    ("granularity", "ref"),
    [(PerTensor(), ("tensor", 0)), (PerChannel(0), ("channel", 0)), (PerGroup(8), ("group", 8)),
     (PerGroup(7), ("group", 7))],
    ids=["tensor", "channel", "group8", "group7-short-last"],
)  # fmt: skip
def test_weight_means_normalise_by_each_group_max(
    granularity: Granularity, ref: tuple[str, int]
) -> None:
    weights = [_rand(6, 24, seed=1), _rand(10, 24, seed=2) * 5]  # q, k, v-like: one input
    spec = QSpec(Scheme.ASYM, StorageDtype.UINT4, granularity)
    got = awq.weight_means(weights, spec)
    want = reference.awq_weight_means([w.numpy() for w in weights], ref)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


@pytest.mark.parametrize("duo", [True, False], ids=["duo", "activations-only"])
@pytest.mark.parametrize("alpha", [0.0, 1 / 18, 0.5, 1.0])
def test_scales_follow_the_formula(alpha: float, duo: bool) -> None:
    x_mean = _rand(32, seed=3).abs() * 3
    x_mean[4] = 0.0  # a column that never fires: floored at 1e-4
    w_mean = _rand(32, seed=4).abs().clamp(max=1.0)
    got = awq.scales_for(x_mean, w_mean, alpha, duo)
    want = reference.awq_scales(x_mean.numpy(), w_mean.numpy(), alpha, duo)
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-6)
    assert math.isclose(float(got.max() * got.min()), 1.0, rel_tol=1e-5)


def test_identity_candidate_is_all_ones() -> None:
    x_mean, w_mean = _rand(16, seed=5).abs(), _rand(16, seed=6).abs()
    assert torch.equal(awq.scales_for(x_mean, w_mean, 0.0, False), torch.ones(16))


def test_grid_is_llm_compressors() -> None:
    duo = awq.grid()
    assert len(duo) == 20 and duo[0] == (0.0, False)
    assert [a for a, _ in duo[1:]] == [i / 18 for i in range(19)] and all(d for _, d in duo[1:])
    plain = awq.grid(duo_scaling=False)
    assert plain == [(i / 19, False) for i in range(20)]
    with pytest.raises(ValueError, match="3 points"):
        awq.grid(2)


# ---- the search ----


def test_search_keeps_the_smallest_loss_first_on_ties_and_skips_nan() -> None:
    x_mean, w_mean = _rand(8, seed=7).abs(), _rand(8, seed=8).abs()
    candidates = [(0.0, False), (0.25, True), (0.5, True), (0.75, True), (1.0, True)]
    values = iter([3.0, float("nan"), 1.0, 1.0, 2.0])
    seen: list[torch.Tensor] = []

    def loss(s: torch.Tensor) -> float:
        seen.append(s)
        return next(values)

    got = awq.search(loss, x_mean, w_mean, candidates)
    assert (got.alpha, got.duo, got.loss, got.identity_loss) == (0.5, True, 1.0, 3.0)
    assert torch.equal(got.scales, awq.scales_for(x_mean, w_mean, 0.5, True))
    assert torch.equal(seen[0], torch.ones(8)) and len(seen) == 5
    assert math.isnan(got.losses[1])
    with pytest.raises(awq.NonFiniteLoss):
        awq.search(lambda s: float("inf"), x_mean, w_mean, candidates)


def test_search_finds_the_scales_that_protect_a_loud_input() -> None:
    # one input column carries 50x the others: the output error of the quantized Linear is
    # dominated by that column's weights, which scaling up protects
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(256, 64, generator=gen)
    x[:, 5] *= 50.0
    w = torch.randn(32, 64, generator=gen)
    spec = QSpec(Scheme.ASYM, StorageDtype.UINT4, PerGroup(32))
    means = awq.AbsMean(64)
    means.add(x)

    def loss(s: torch.Tensor) -> float:
        return float(((x @ awq.quantized_scaled(w, s, spec).T - x @ w.T) ** 2).mean())

    got = awq.search(loss, means.mean, awq.weight_means([w], spec))
    assert got.loss < 0.7 * got.identity_loss and got.alpha > 0


def test_quantized_scaled_is_q_of_ws_over_s() -> None:
    w = _rand(4, 16, seed=10)
    s = _rand(16, seed=11).abs() + 0.5
    spec = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(8))
    codes, scales, zps, _ = reference.quantize_v2((w * s).numpy(), "sym", "int4", ("group", 8))
    cols = np.arange(16) // 8
    want = (codes - zps[:, cols]).astype(np.float32) * scales[:, cols] / s.numpy()
    np.testing.assert_array_equal(awq.quantized_scaled(w, s, spec).numpy(), want)
    rtn = kernels.quantize_tensor(w, spec, with_errors=False)
    plain = kernels.dequantize(rtn.q, rtn.scale, rtn.zero_point, spec, shape=(4, 16))
    assert torch.equal(awq.quantized_scaled(w, torch.ones(16), spec), plain)


# ---- folding leaves the float model's function unchanged ----


def _tiny(kind: str) -> Any:
    transformers = pytest.importorskip("transformers")
    common: dict[str, Any] = {
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64,
    }  # fmt: skip
    torch.manual_seed(0)
    if kind == "qwen2":  # q, k, v with biases
        model = transformers.Qwen2Model(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaModel(transformers.LlamaConfig(**common))
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norms and biases
            if p.ndim == 1:
                p.copy_(torch.randn(p.shape) * 0.5 + 1.0)
    return model.float().eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_folding_leaves_the_block_outputs_unchanged(kind: str) -> None:
    model = _tiny(kind)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        before = model(ids).last_hidden_state
    gen = torch.Generator().manual_seed(13)

    def scales(n: int) -> torch.Tensor:
        return torch.exp(torch.randn(n, generator=gen))  # from 1/20 to 20

    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        s = scales(32)
        awq.scale_inputs([attn.q_proj, attn.k_proj, attn.v_proj], s)
        awq.fold_into_norm(layer.input_layernorm, s)
        s = scales(32)
        awq.scale_inputs([attn.o_proj], s)
        awq.fold_into_linear(attn.v_proj, s)
        s = scales(32)
        awq.scale_inputs([mlp.gate_proj, mlp.up_proj], s)
        awq.fold_into_norm(layer.post_attention_layernorm, s)
        s = scales(48)
        awq.scale_inputs([mlp.down_proj], s)
        awq.fold_into_linear(mlp.up_proj, s)
    with torch.no_grad():
        after = model(ids).last_hidden_state
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    fresh = _tiny(kind)  # the same seed: the weights as they were before folding
    for name in ("input_layernorm.weight", "self_attn.v_proj.weight", "mlp.down_proj.weight"):
        assert not torch.equal(
            model.layers[0].get_parameter(name), fresh.layers[0].get_parameter(name)
        )


def test_folding_into_a_layernorm_with_bias() -> None:
    torch.manual_seed(14)
    norm, linear = torch.nn.LayerNorm(16), torch.nn.Linear(16, 8)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
        norm.bias.normal_(0.0, 0.3)
    x = torch.randn(5, 16)
    with torch.no_grad():
        before = linear(norm(x))
        s = torch.exp(torch.randn(16))
        awq.scale_inputs([linear], s)
        awq.fold_into_norm(norm, s)
        after = linear(norm(x))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


class _OffsetNorm(torch.nn.Module):
    """Gemma's RMSNorm form: (1 + weight) * x / rms(x)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1.0 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_a_norm_that_does_not_scale_with_its_weight_is_refused_and_left_as_it_was() -> None:
    norm = _OffsetNorm(16)
    saved = norm.weight.detach().clone()
    with pytest.raises(ValueError, match="does not scale"):
        awq.fold_into_norm(norm, torch.full((16,), 2.0))
    assert torch.equal(norm.weight.detach(), saved)


def test_widths_must_match() -> None:
    v = torch.nn.Linear(32, 16)  # grouped-query attention: v is narrower than o's input
    with pytest.raises(ValueError, match="width 16"):
        awq.fold_into_linear(v, torch.ones(32))
    with pytest.raises(ValueError, match="width 32"):
        awq.scale_inputs([v], torch.ones(16))
    with pytest.raises(ValueError, match="16 input columns"):
        awq.weight_means([torch.ones(4, 16), torch.ones(4, 8)], QSpec())
    with pytest.raises(ValueError, match="output channel"):
        awq.weight_means([torch.ones(4, 16)], QSpec(granularity=PerChannel(1)))
    with pytest.raises(ValueError, match="no 1-D weight"):
        awq.fold_into_norm(torch.nn.ReLU(), torch.ones(4))
