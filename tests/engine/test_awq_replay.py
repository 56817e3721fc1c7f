"""engine/methods/replay.py: AWQ's search replays the modules that run before a group's Linears
from their recorded outputs. The replayed forward gives the same bits as a whole one (each
group, each stream, over calls with other weights in the group), the modules chosen follow the
order the block ran in (not names), the records stay within their bound, and a whole
`--method awq` run writes the same bytes with the replay as without it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

from qtool import api  # noqa: E402
from qtool.calibration import Calibration, Method  # noqa: E402
from qtool.engine.methods import awq as method  # noqa: E402
from qtool.engine.methods import replay  # noqa: E402
from qtool.engine.plan import QuantizeOptions  # noqa: E402
from qtool.spec import PerGroup, QSpec, Scheme, StorageDtype  # noqa: E402
from tests.eval_models import build  # noqa: E402

CTX = 32


def _layer() -> tuple[torch.nn.Module, dict[str, Any], list[torch.Tensor]]:
    """A Llama decoder layer (grouped-query attention: no v -> o group), its keyword arguments
    and three windows of hidden states."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    layer = model.model.layers[0]
    xs = [torch.randn(1, CTX, 64) for _ in range(3)]
    positions = torch.arange(CTX)[None]
    kwargs = {"position_embeddings": model.model.rotary_emb(xs[0], positions),
              "position_ids": positions}  # fmt: skip
    return layer, kwargs, xs


def _probe(layer: torch.nn.Module, kwargs: dict[str, Any], xs: list[torch.Tensor]) -> Any:
    outputs = [torch.empty(1, CTX, 64) for _ in xs]
    probe = method.AwqProbe(layer, method.groups(layer), outputs)
    probe.kwargs = kwargs
    with torch.no_grad():
        for k, x in enumerate(xs):
            y = layer(x, **kwargs)
            outputs[k].copy_(y[0] if isinstance(y, tuple) else y)
    probe.inputs["fit"] = list(xs)
    return probe


def test_a_replayed_forward_is_the_whole_forwards_bits() -> None:
    """For each group, with its Linears' weights changed between calls (as the candidates
    change them), the error with replay equals the error of a whole forward exactly; and the
    replay did skip work: the attention does not run in the MLP groups' replayed calls."""
    layer, kwargs, xs = _layer()
    probe = _probe(layer, kwargs, xs)
    attention_calls = []
    layer.self_attn.register_forward_hook(lambda *_: attention_calls.append(1))
    modules = dict(layer.named_modules())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for group in probe.groups:
            originals = [modules[n].weight.clone() for n in group.linears]
            for trial in range(4):
                for n in group.linears:
                    w = modules[n].weight
                    w.mul_(1 + 0.1 * torch.randn(w.shape, generator=g))
                before = len(attention_calls)
                replayed = probe.error("fit", group)
                ran_attention = len(attention_calls) - before
                whole = probe.error("fit")
                assert replayed == whole, (group, trial)
                if group.linears[0].startswith("mlp.") and trial > 0:
                    assert ran_attention == 0, group
            for n, w in zip(group.linears, originals, strict=True):
                modules[n].weight.copy_(w)
            probe.forget(group)
    assert not probe.recorded


def test_the_modules_replayed_follow_the_order_they_ran_in() -> None:
    layer, kwargs, xs = _layer()
    ran: dict[str, replay.Ran] = {}
    with torch.no_grad(), replay.execution(layer, ran):
        layer(xs[0], **kwargs)
    down = replay.fixed_modules(layer, ran, ("mlp.down_proj",), 1)
    assert set(down) == {"input_layernorm", "self_attn", "post_attention_layernorm",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.act_fn"}  # fmt: skip
    gate_up = replay.fixed_modules(layer, ran, ("mlp.gate_proj", "mlp.up_proj"), 1)
    assert set(gate_up) == {"input_layernorm", "self_attn", "post_attention_layernorm"}
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert replay.fixed_modules(layer, ran, qkv, 1) == ("input_layernorm",)
    # registered in another order than they run (self_attn, mlp, then the norms): order wins
    assert [n for n, _ in layer.named_children()][:2] == ["self_attn", "mlp"]


def test_the_records_stay_within_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, kwargs, xs = _layer()
    ran: dict[str, replay.Ran] = {}
    with torch.no_grad(), replay.execution(layer, ran):
        layer(xs[0], **kwargs)
    down = ("mlp.down_proj",)
    whole = sum(ran[n].nbytes or 0 for n in replay.fixed_modules(layer, ran, down, 1))
    children = {"input_layernorm", "self_attn", "post_attention_layernorm"}
    top = sum(ran[n].nbytes or 0 for n in children)
    monkeypatch.setattr(replay, "REPLAY_BYTES", 2 * whole)
    assert len(replay.fixed_modules(layer, ran, down, 2)) == 6
    assert set(replay.fixed_modules(layer, ran, down, 3)) == children  # narrowed
    assert replay.fixed_modules(layer, ran, down, 2 * whole // top + 1) == ()


class _InPlace(torch.nn.Module):
    """A block whose code changes a module's output in place after using it."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.lin = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        y = self.lin(h)
        h.add_(1.0)
        return y + h


def test_a_record_changed_in_place_is_never_replayed() -> None:
    """The stubs return the recorded tensors themselves: a forward that changes one in place
    ends the replay, and every later forward still gives the whole forward's result."""
    torch.manual_seed(0)
    block, x = _InPlace(), torch.randn(4, 8)
    with torch.no_grad():
        want = block(x)
        ran: dict[str, replay.Ran] = {}
        with replay.execution(block, ran):
            block(x)
        recorded = replay.Recorded(block, replay.fixed_modules(block, ran, ("lin",), 1))
        assert recorded.names == ("pre",)
        for _ in range(3):
            context = recorded.replaying(0) if recorded.has(0) else recorded.record(0)
            with context:
                got = block(x)
            assert torch.equal(got, want)
    assert recorded.names == ()


def test_a_whole_run_writes_the_same_bytes_with_and_without_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "m"
    root.mkdir()
    (root / "calib.txt").write_text(" ".join(f"alpha {i} beta {i * 7 % 13}." for i in range(80)))
    (root / "check.txt").write_text(" ".join(f"Delta{i}: epsilon zeta {i % 5}!" for i in range(40)))
    model = build(root / "llama", "llama")
    data = Calibration(Method.AWQ, texts=(root / "calib.txt",), tokens=8 * CTX, ctx=CTX,
                       check_texts=(root / "check.txt",))  # fmt: skip
    options = QuantizeOptions(QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(16)),
                              calibration=dataclasses.replace(data))  # fmt: skip
    calls = []
    fixed = replay.fixed_modules

    def counted(*args: Any) -> tuple[str, ...]:
        found = fixed(*args)
        calls.append(found)
        return found

    monkeypatch.setattr(replay, "fixed_modules", counted)
    api.quantize(model, tmp_path / "replayed", options, device="cpu")
    assert any(calls) and any("self_attn" in c for c in calls)
    monkeypatch.setattr(replay, "fixed_modules", lambda *args: ())
    api.quantize(model, tmp_path / "whole", options, device="cpu")
    for f in sorted((tmp_path / "whole").glob("*.safetensors")):
        assert f.read_bytes() == (tmp_path / "replayed" / f.name).read_bytes(), f.name
