"""`quantize --method awq` (engine/methods/awq.py) on the tiny Llama built here: the balanced
groups found from the block's modules fold into a model computing the same logits; the output,
loaded by transformers (compressed-tensors' default path) or dequantized by qtool, is the
method's model (its folded norms written, its codes of the scaled weights); the guard rounds to
nearest where AWQ is made to lose, and keeps it where the policy says so."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from qtool import api  # noqa: E402
from qtool.calibration import Calibration, Guard, Method  # noqa: E402
from qtool.engine.methods import awq as method  # noqa: E402
from qtool.engine.plan import QuantizeOptions  # noqa: E402
from qtool.engine.spill import Spill  # noqa: E402
from qtool.numerics import awq  # noqa: E402
from qtool.spec import PerChannel, PerGroup, QSpec, Scheme, StorageDtype  # noqa: E402
from tests.conftest import Invoke  # noqa: E402
from tests.eval_models import build  # noqa: E402

CTX = 32
TEXT = " ".join(f"alpha {i} beta {i * 7 % 13} gamma." for i in range(80))
CHECK = " ".join(f"Delta{i}: epsilon zeta eta {i % 5}!" for i in range(40))
SPEC = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(16))
NORMS = ("input_layernorm", "post_attention_layernorm")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("awq")
    (root / "calib.txt").write_text(TEXT)
    (root / "check.txt").write_text(CHECK)
    return build(root / "llama", "llama")


def _options(model: Path, fmt: str = "qtool", **calibration: Any) -> QuantizeOptions:
    root = model.parent
    data = Calibration(
        Method.AWQ, texts=(root / "calib.txt",), tokens=8 * CTX, ctx=CTX,
        check_texts=(root / "check.txt",),
    )  # fmt: skip
    return QuantizeOptions(SPEC, format=fmt, calibration=dataclasses.replace(data, **calibration))


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(f)
    return tensors


def _ids(n: int = 2) -> torch.Tensor:
    return torch.randint(3, 250, (n, CTX), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_folded_float_model_gives_the_same_logits(kv_heads: int) -> None:
    """Every group the mapping finds, folded with random scales (norm weights random too, so a
    fold into the wrong side shows), leaves the logits within float tolerance; v -> o only
    without grouped-query attention."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
        initializer_range=0.2,
    )  # fmt: skip
    llama = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in llama.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 2.0)
        before = llama(_ids()).logits
        g = torch.Generator().manual_seed(2)
        for block in llama.model.layers:
            groups = method.groups(block)
            want = ["input_layernorm", "post_attention_layernorm", "mlp.up_proj"]
            if kv_heads == 4:
                want.insert(1, "self_attn.v_proj")
            assert [grp.previous for grp in groups] == want
            for grp in groups:
                width = dict(block.named_modules())[grp.linears[0]].in_features
                method.fold(block, grp, torch.empty(width).uniform_(0.25, 4.0, generator=g))
        after = llama(_ids()).logits
    assert (after - before).abs().max() <= 1e-4 * before.abs().max()
    assert llama.model.layers[0].input_layernorm.weight.max() != 2.0  # the fold changed it


def test_the_output_is_the_methods_model(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block states the method ends with (folded norms rounded to bf16, every Linear as a
    consumer reconstructs it) are what qtool's dequantized output holds, tensor for tensor, and
    what transformers loads from the compressed-tensors export (same logits); some norm was
    changed (so the writer took the method's values, not the input's bytes), and some Linear's
    codes are AWQ's."""
    states: dict[str, torch.Tensor] = {}
    per_format: dict[str, dict[str, torch.Tensor]] = {}
    quantize = method.AwqPolicy.quantize

    def spy(self: method.AwqPolicy, prefix: str, probe: method.AwqProbe) -> None:
        quantize(self, prefix, probe)
        states.update({f"{prefix}{k}": v.clone() for k, v in probe.block.state_dict().items()})

    monkeypatch.setattr(method.AwqPolicy, "quantize", spy)
    original = _tensors(model)
    rows = {}
    for fmt in ("qtool", "compressed-tensors"):
        summary = api.quantize(model, tmp_path / fmt, _options(model, fmt), device="cpu")
        rows[fmt] = {r.name: r for r in summary.rows}
        per_format[fmt], states = states, {}
    methods = {r.decided_by.method for r in rows["qtool"].values() if r.decided_by}
    assert {"awq", "rtn"} <= methods
    states = per_format["qtool"]  # scales in float32; compressed-tensors': in bf16
    changed = [n for n in states if n.rsplit(".", 2)[-2] in NORMS]
    changed = [n for n in changed if not torch.equal(states[n], original[n].float())]
    assert changed and all("scaled by awq" in rows["qtool"][n].detail for n in changed)

    api.dequantize(tmp_path / "qtool", tmp_path / "restored")
    restored = _tensors(tmp_path / "restored")
    for name, want in states.items():
        torch.testing.assert_close(restored[name].float(), want, rtol=0, atol=0, msg=name)

    llama = transformers.LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ct = per_format["compressed-tensors"]
    llama.load_state_dict({**{k: v.float() for k, v in original.items()}, **ct}, strict=False)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "compressed-tensors")
    with torch.no_grad():
        got = loaded.eval()(_ids()).logits  # the default path decompresses on the first forward
        want_logits = llama.to(torch.bfloat16)(_ids()).logits
    weights = loaded.state_dict()
    for name, want in ct.items():
        torch.testing.assert_close(weights[name].float(), want, rtol=0, atol=0, msg=name)
    assert got.dtype == torch.bfloat16  # its kernels round otherwise: a few bf16 steps apart
    torch.testing.assert_close(got.float(), want_logits.float(), rtol=0.02, atol=0.2)


def _content(path: Path) -> tuple[dict[str, bytes], dict[str, str]]:
    """A safetensors file's tensors as bytes and its metadata, but for what differs between a
    method's run and a plain one by design: the texts it records (qtool.texts) and the binding
    digest over the whole sidecar, which covers them."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        names = list(f.keys())  # noqa: SIM118 (safe_open has no __iter__)
        tensors = {k: f.get_tensor(k).view(-1).view(torch.uint8).numpy().tobytes() for k in names}
        meta = dict(f.metadata() or {})
    skip = {"qtool.texts", "qtool.binding_sha256"}
    return tensors, {k: v for k, v in meta.items() if k not in skip}


def _losing(loss: Any, x_mean: torch.Tensor, w_mean: Any, candidates: Any = None) -> Any:
    """A search that returns scales wild enough to wreck every group."""
    s = torch.where(torch.arange(x_mean.shape[0]) % 2 == 0, 64.0, 1 / 64)
    return awq.AwqChoice(s, 0.5, True, 0.0, 0.0, (0.0,))


@pytest.mark.parametrize("fmt", ["qtool", "compressed-tensors"])
def test_the_guard_rounds_to_nearest_where_awq_loses(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """With the scales of a losing search: under --guard both every Linear is rounded to
    nearest and the output is byte for byte a plain run's (no norm rewritten, no code of
    scaled weights); under --guard none the same scales are kept (the guard decided it)."""
    monkeypatch.setattr(awq, "search", _losing)
    guarded = api.quantize(model, tmp_path / "guarded", _options(model, fmt), device="cpu")
    linears = [r for r in guarded.rows if r.quantized and ".layers." in r.name]
    assert len(linears) == 14 and {r.decided_by.method for r in linears} == {"rtn"}
    assert all("rtn, awq: +" in r.detail for r in linears if "q_proj" in r.name)
    api.quantize(model, tmp_path / "plain", QuantizeOptions(SPEC, format=fmt), device="cpu")
    for f in sorted((tmp_path / "plain").glob("*.safetensors")):
        assert _content(f) == _content(tmp_path / "guarded" / f.name)
    unguarded = api.quantize(
        model, tmp_path / "none", _options(model, fmt, guard=Guard.NONE), device="cpu"
    )
    assert "awq" in {r.decided_by.method for r in unguarded.rows if r.quantized}
    norms = {n: t for n, t in _tensors(tmp_path / "none").items() if "layernorm" in n}
    assert any(not torch.equal(t, _tensors(model)[n]) for n, t in norms.items())


def test_changed_float_values_wait_in_the_file(tmp_path: Path) -> None:
    """put_float keeps the values in the spill file (read back equal, once), not in memory;
    a dry run's spill keeps none."""
    spill = Spill(tmp_path)
    values = torch.arange(8, dtype=torch.bfloat16)
    spill.put_float("n.weight", values)
    values.zero_()  # the spill holds its own copy
    got = spill.take_float("n.weight")
    assert got is not None and torch.equal(got, torch.arange(8, dtype=torch.bfloat16))
    assert spill.take_float("n.weight") is None
    spill.close()
    dry = Spill(None)
    dry.put_float("n.weight", values)
    assert dry.take_float("n.weight") is None


def _args(model: Path, *more: str) -> list[str]:
    return ["quantize", str(model), "--method", "awq", "--text", str(model.parent / "calib.txt"),
            "--check-text", str(model.parent / "check.txt"), "--tokens", "256", "--ctx", "32",
            "--dtype", "int4", "--group-size", "16", *more]  # fmt: skip


def test_the_run_counts_the_linears_it_decided(model: Path, tmp_path: Path, invoke: Invoke) -> None:
    """The stderr line counts the 14 Linear layers, not the norms AWQ rewrote (kept float)."""
    rc, stdout, err = invoke(*_args(model, "-o", str(tmp_path / "out")))
    assert rc == 0, err
    assert " of 14 Linear layers of the decoder blocks" in err and "awq kept for" in err, err
    assert "(awq: " in stdout and "scaled by awq" in stdout


@pytest.mark.parametrize(
    ("more", "code", "words"),
    [
        (["--format", "gguf"], 2, "not GGUF types"),
        (["--target-sqnr", "30"], 2, "drop one of them"),
        (["--imatrix", "x.imatrix.gguf"], 2, "chooses its codes from its own statistics"),
        (["--model-type", "olmo"], 1, "runs the Llama family"),
    ],
)
def test_what_awq_cannot_do_is_refused(
    model: Path, tmp_path: Path, invoke: Invoke, more: list[str], code: int, words: str
) -> None:
    source = model
    if more[0] == "--model-type":  # an architecture whose blocks it does not know
        source = tmp_path / "olmo"
        shutil.copytree(model, source)
        config = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps(config | {"model_type": more[1]}))
        (source.parent / "calib.txt").write_text(TEXT)
        (source.parent / "check.txt").write_text(CHECK)
        more = []
    rc, stdout, err = invoke(*_args(source, "-o", str(tmp_path / "out"), *more))
    assert (rc, stdout) == (code, ""), err
    assert words in err.strip().splitlines()[-1] and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_identity_scales_are_round_to_nearest_whatever_the_guard(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the search's best is s = 1, nothing is folded and no Linear claims AWQ's codes,
    even under --guard none (which keeps whatever the method chose)."""

    def identity(loss: Any, x_mean: torch.Tensor, *args: Any) -> Any:
        return awq.AwqChoice(torch.ones_like(x_mean), 0.0, False, 0.0, 0.0, (0.0,))

    monkeypatch.setattr(awq, "search", identity)
    summary = api.quantize(model, tmp_path / "o", _options(model, guard=Guard.NONE), device="cpu")
    linears = [r for r in summary.rows if r.quantized and ".layers." in r.name]
    assert {r.decided_by.method for r in linears if r.decided_by} == {"rtn"}
    assert not [r for r in summary.rows if "scaled by awq" in r.detail]


def test_a_grid_across_output_rows_is_rounded_to_nearest(model: Path, tmp_path: Path) -> None:
    """Scales per input column cannot be balanced against qparams per input column (channels on
    axis 1): each group is rounded to nearest and says why, instead of the run failing."""
    spec = QSpec(Scheme.SYM, StorageDtype.INT8, PerChannel(1))
    options = dataclasses.replace(_options(model), spec=spec)
    summary = api.quantize(model, tmp_path / "o", options, device="cpu")
    linears = [r for r in summary.rows if r.quantized and ".layers." in r.name]
    assert linears and {r.decided_by.method for r in linears if r.decided_by} == {"rtn"}
    assert all("rtn, awq: AWQ balances Linears quantized per tensor" in r.detail for r in linears
               if "o_proj" not in r.name)  # fmt: skip


def test_a_fold_needs_somewhere_to_write_the_module_before(tmp_path: Path) -> None:
    """A group is balanced only where every tensor its fold changes is written with the
    method's values: a norm the output keeps float, a Linear before whose codes the method
    writes; a norm the plan quantizes otherwise (a recipe's), or a bias it quantizes, is not."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, attention_bias=True,
    )  # fmt: skip
    block = transformers.LlamaForCausalLM(cfg).model.layers[0]
    modules = dict(block.named_modules())
    probe = method.AwqProbe(block, method.groups(block), [])
    probe.means = {g.previous: awq.AbsMean(64) for g in probe.groups}
    target = method.Target(SPEC, torch.bfloat16)
    linears = {f"{n}.weight": target for n, m in modules.items() if isinstance(m, torch.nn.Linear)}
    floats = {f"{n}.{p}": torch.bfloat16 for n, m in modules.items() for p in ("weight", "bias")
              if not isinstance(m, torch.nn.Linear) or p == "bias"}  # fmt: skip

    def why(targets: dict[str, Any], kept: dict[str, Any]) -> list[str | None]:
        calibration = Calibration(Method.AWQ)
        policy = method.AwqPolicy(targets, kept, calibration, Spill(None), False, [])
        return [policy._unbalanced("", g, modules, probe) for g in probe.groups]

    assert why(linears, floats) == [None, None, None, None]
    norm = {**linears, "input_layernorm.weight": target}
    kept = {k: v for k, v in floats.items() if k != "input_layernorm.weight"}
    assert why(norm, kept)[0] == "input_layernorm.weight is quantized otherwise"
    bias = {k: v for k, v in floats.items() if k != "self_attn.v_proj.bias"}
    assert why({**linears, "self_attn.v_proj.bias": target}, bias)[1] == (
        "self_attn.v_proj.bias is quantized otherwise"
    )
