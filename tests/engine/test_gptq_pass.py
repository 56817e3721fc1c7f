"""`quantize --method gptq` block by block (engine/methods, engine/calibrate/sequential.py) on the
tiny Llama built here: block b's Linears see block b-1's QUANTIZED outputs (the error
propagates); the codes the writer stores are the ones the method chose (dequantized weight ==
the method's reconstruction), in both formats, and the manifest says which method made them;
the guard rounds to nearest where GPTQ loses (a stand-in made to lose) and keeps it where the
policy says so; at most one block is real while the pass runs, and the chosen codes wait in the
spill file, not in memory."""

from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from qtool import api  # noqa: E402
from qtool.calibration import Calibration, Guard, Method  # noqa: E402
from qtool.engine.calibrate import blocks, sequential  # noqa: E402
from qtool.engine.methods import gptq as method  # noqa: E402
from qtool.engine.methods import run as method_run  # noqa: E402
from qtool.engine.methods.guard import describe, judge  # noqa: E402
from qtool.engine.plan import QuantizeOptions  # noqa: E402
from qtool.engine.spill import Spill  # noqa: E402
from qtool.numerics import gptq, kernels  # noqa: E402
from qtool.spec import PerChannel, PerGroup, QSpec, Scheme, StorageDtype  # noqa: E402
from tests.eval_models import build  # noqa: E402

CTX = 32
TEXT = " ".join(f"alpha {i} beta {i * 7 % 13} gamma." for i in range(80))
CHECK = " ".join(f"Delta{i}: epsilon zeta eta {i % 5}!" for i in range(40))
SPEC = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(16))


def calibration_model(root: Path) -> Path:
    """A tiny Llama with a calibration text and a check text beside it (shared by the
    calibrated-method test files)."""
    (root / "calib.txt").write_text(TEXT)
    (root / "check.txt").write_text(CHECK)
    return build(root / "llama", "llama")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return calibration_model(tmp_path_factory.mktemp("gptq"))


def _options(model: Path, fmt: str = "qtool", **calibration: Any) -> QuantizeOptions:
    root = model.parent
    data = Calibration(
        texts=(root / "calib.txt",), tokens=8 * CTX, ctx=CTX, check_texts=(root / "check.txt",)
    )
    return QuantizeOptions(SPEC, format=fmt, calibration=dataclasses.replace(data, **calibration))


def _quantize(model: Path, out: Path, options: QuantizeOptions) -> Any:
    return api.quantize(model, out, options, device="cpu", force=True)


def _restored(out: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The output dequantized by qtool (as a consumer restores it), as float32."""
    target = tmp / f"{out.name}.restored"
    api.dequantize(out, target, force=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(target.glob("*.safetensors")):
        tensors |= {k: v.float() for k, v in load_file(f).items()}
    return tensors


def _q_proj_inputs(model: Any, windows: list[list[int]], block: int) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    q = model.model.layers[block].self_attn.q_proj
    handle = q.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    with torch.no_grad():
        for w in windows:
            model(torch.tensor([w]))
    handle.remove()
    return seen


def test_block_b_sees_block_b_minus_1s_quantized_outputs(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spy on block 1's q_proj inputs during pass 1 (the Hessians' inputs) against the float
    model run with block 0's Linears replaced by the output's dequantized weights: equal, and
    not the float model's own (which a pass propagating float outputs would give)."""
    streams: list[dict[str, Any]] = []
    seen: dict[str, list[torch.Tensor]] = {}
    run = method_run.run_sequential

    def spy_run(
        model_: Any, reader: Any, streams_: Any, policy: Any, *args: Any, **kw: Any
    ) -> None:
        streams.append(streams_)
        probe = policy.probe

        def spy_probe(block: Any, prefix: str) -> Any:
            p = probe(block, prefix)

            def hook(m: Any, a: tuple[Any, ...]) -> None:
                if p.stream == "fit" and not p.done:
                    seen.setdefault(prefix, []).append(a[0].detach().clone())

            p.done = False
            handles.append(block.self_attn.q_proj.register_forward_pre_hook(hook))
            return p

        quantize = policy.quantize

        def spy_quantize(prefix: str, p: Any) -> None:
            p.done = True
            quantize(prefix, p)

        handles: list[Any] = []
        monkeypatch.setattr(policy, "probe", spy_probe)
        monkeypatch.setattr(policy, "quantize", spy_quantize)
        run(model_, reader, streams_, policy, *args, **kw)

    monkeypatch.setattr(method_run, "run_sequential", spy_run)
    out = tmp_path / "out"
    _quantize(model, out, _options(model))
    fit = streams[0]["fit"]
    assert len(fit) == 7 and len(streams[0]["held"]) == 1 and len(streams[0]["check"]) == 1

    float_model = transformers.LlamaForCausalLM.from_pretrained(model, dtype=torch.float32)
    float_inputs = _q_proj_inputs(float_model.eval(), fit, 1)
    restored = _restored(out, tmp_path)
    block0 = {k.removeprefix("model."): v for k, v in restored.items() if ".layers.0." in k}
    float_model.model.load_state_dict(block0, strict=False)
    quant_inputs = _q_proj_inputs(float_model, fit, 1)
    got = seen["model.layers.1."]
    assert len(got) == len(fit)
    for g, want, floated in zip(got, quant_inputs, float_inputs, strict=True):
        torch.testing.assert_close(g, want, atol=1e-4, rtol=1e-4)
        assert (g - floated).abs().max() > 1e-3  # block 0's quantization reached block 1


def test_the_writer_stores_the_codes_the_method_chose(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every Linear's dequantized weight (qtool and compressed-tensors) is the reconstruction
    the method chose; the qtool manifest says `gptq` for GPTQ's codes and nothing for rounding;
    the rows say which method and the figures are against the original weights."""
    chosen: dict[str, tuple[torch.Tensor, str]] = {}
    choose = method.GptqPolicy._choose
    names = iter(())

    def spy(self: Any, weight: torch.Tensor, *args: Any) -> Any:
        result, w, pick = choose(self, weight, *args)
        chosen[next(names)] = (w.clone(), pick.method)
        return result, w, pick

    quantize = method.GptqPolicy.quantize

    def spy_quantize(self: Any, prefix: str, probe: Any) -> None:
        nonlocal names
        names = iter([f"{prefix}{n}.weight" for n in probe.linears])
        quantize(self, prefix, probe)

    monkeypatch.setattr(method.GptqPolicy, "_choose", spy)
    monkeypatch.setattr(method.GptqPolicy, "quantize", spy_quantize)
    original = load_file(model / "model.safetensors")
    for fmt in ("qtool", "compressed-tensors"):
        chosen.clear()
        out = tmp_path / fmt
        summary = _quantize(model, out, _options(model, fmt, guard=Guard.NONE))
        restored = _restored(out, tmp_path)
        assert len(chosen) == 14
        for name, (weight, picked) in chosen.items():
            assert picked == "gptq"
            assert torch.equal(restored[name], weight), name
        rows = {r.name: r for r in summary.rows}
        for name in chosen:
            row = rows[name]
            assert row.decided_by.origin == "calibrated" and row.decided_by.method == "gptq"
            want = original[name].float()
            err = float(((want - restored[name]) ** 2).sum())
            assert row.errors.sq_error == pytest.approx(err, rel=1e-5)
    sidecar = next((tmp_path / "qtool").glob("*.qparams.safetensors"))
    with safe_open(sidecar, "pt") as f:
        manifest = json.loads(f.metadata()["qtool.qparams"])
    methods = {n: r.get("method") for n, r in manifest["tensors"].items()}
    assert methods == dict.fromkeys(chosen, "gptq") | {
        "lm_head.weight": None,
        "model.embed_tokens.weight": None,  # rounded by the usual loop
    }


def _losing(weight: torch.Tensor, hessian: torch.Tensor, spec: QSpec, **kw: Any) -> Any:
    """A stand-in for GPTQ made to lose: round to nearest, then every other code moved by one
    step (clamped), so its error is larger on every stream."""
    rtn = kernels.quantize_tensor(weight, spec, scale_dtype=kw.get("scale_dtype", torch.float32))
    codes = kernels.dequantize(rtn.q, rtn.scale, rtn.zero_point, spec, shape=tuple(weight.shape))
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = rtn.scale.reshape(weight.shape[0], -1).repeat_interleave(16, dim=1)
    q.copy_(torch.round(codes / scale).to(torch.int8))
    q[:, ::2] = torch.where(q[:, ::2] < spec.qmax, q[:, ::2] + 1, q[:, ::2] - 1)
    return gptq.GPTQResult(q, rtn.scale, rtn.zero_point, 0.01, None)


def test_the_guard_rounds_to_nearest_where_gptq_loses(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With GPTQ made to lose, every Linear is rounded to nearest under --guard both and domain
    (the output is a plain run's, byte for byte in the dequantized weights) and the note says
    by how much it lost; --guard none keeps the loser, so the guard is what decided."""
    monkeypatch.setattr(gptq, "gptq_quantize", _losing)
    plain = _restored(_quantize_plain(model, tmp_path / "plain"), tmp_path)
    for guard in (Guard.BOTH, Guard.DOMAIN):
        out = tmp_path / guard.value
        summary = _quantize(model, out, _options(model, guard=guard))
        linears = [r for r in summary.rows if r.decided_by.method is not None]
        assert len(linears) == 14
        assert all(r.decided_by.method == "rtn" for r in linears)
        assert all("rtn, gptq: +" in r.detail and "% held out" in r.detail for r in linears)
        restored = _restored(out, tmp_path)
        assert all(torch.equal(restored[n], plain[n]) for n in plain)
    summary = _quantize(model, tmp_path / "none", _options(model, guard=Guard.NONE))
    assert {r.decided_by.method for r in summary.rows if r.decided_by.method} == {"gptq"}


def _quantize_plain(model: Path, out: Path) -> Path:
    api.quantize(model, out, QuantizeOptions(SPEC), device="cpu", force=True)
    return out


@pytest.mark.parametrize(
    ("in_domain", "check", "guard", "keep"),
    [
        (-0.2, 0.04, Guard.BOTH, True),
        (-0.2, 0.06, Guard.BOTH, False),  # beyond the tolerance on the check text
        (0.01, -0.5, Guard.BOTH, False),  # no better in domain
        (-0.2, 0.35, Guard.DOMAIN, True),
        (0.0, 0.0, Guard.DOMAIN, False),  # a tie keeps rounding
        (0.5, 0.5, Guard.NONE, True),
    ],
)
def test_the_guards_policies(in_domain: float, check: float, guard: Guard, keep: bool) -> None:
    assert judge(in_domain, check, guard, 0.05).keep is keep


def test_the_notes_say_by_how_much() -> None:
    """One level of words (the table puts the note in parentheses of its own), each figure one
    word (a wrapped cell never splits '-20%'), and a stream with no rows said so, not '+0%'
    (the class: a missing measurement read as 'no change')."""
    assert describe("gptq", judge(-0.2, 0.03, Guard.BOTH, 0.05)) == (
        "gptq: -20% held out, +3% check text"
    )
    assert describe("gptq", judge(-0.2, 0.35, Guard.BOTH, 0.05)) == (
        "rtn, gptq: -20% held out, +35% check text"
    )
    assert describe("awq", judge(-0.2, None, Guard.BOTH, 0.05)) == (
        "awq: -20% held out, no check text rows"
    )
    assert describe("gptq", judge(None, None, Guard.NONE, 0.05)) == (
        "gptq: no held-out rows, no check text rows"
    )
    assert not judge(None, -0.5, Guard.DOMAIN, 0.05).keep  # no held-out rows prove nothing


@pytest.mark.parametrize("which", [Method.GPTQ, Method.AWQ])
def test_no_check_text_rows_is_no_figure(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: Method
) -> None:
    """A run whose check stream reached no Linear (its windows taken away): the notes with
    figures say 'no check text rows', none a percentage on the check text."""
    run = method_run.run_sequential

    def no_check(model_: Any, reader: Any, streams: Any, *args: Any, **kw: Any) -> None:
        run(model_, reader, {**streams, "check": []}, *args, **kw)

    monkeypatch.setattr(method_run, "run_sequential", no_check)
    summary = _quantize(model, tmp_path / "out", _options(model, method=which))
    linears = [r for r in summary.rows if r.quantized and ".layers." in r.name]
    assert len(linears) == 14
    assert all("% check" not in r.detail for r in linears)
    assert sum("held out, no check text rows" in r.detail for r in linears) >= 4


def test_one_block_is_real_at_a_time_and_the_codes_wait_on_file(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spy where each block's probe opens: what of the whole model is real (not meta); and
    every result the method put into the spill is on its file (nothing but figures in memory)
    and taken back by the writer."""
    real: list[set[str]] = []
    whole: list[Any] = []
    run = sequential.run_sequential

    def spy_run(model_: Any, *args: Any, **kw: Any) -> None:
        whole.append(model_)
        policy = args[2]
        probe = policy.probe

        def spy_probe(block: Any, prefix: str) -> Any:
            real.append({n for n, p in whole[0].named_parameters() if not p.is_meta})
            return probe(block, prefix)

        monkeypatch.setattr(policy, "probe", spy_probe)
        run(model_, *args, **kw)

    put, take = Spill.put, Spill.take
    held: list[int] = []
    taken: list[str] = []

    def spy_put(self: Spill, name: str, spec: Any, result: Any) -> None:
        put(self, name, spec, result)
        stored = self._stored[name]
        assert stored.parts and all(isinstance(p.offset, int) for p in stored.parts.values())
        held.append(sum(isinstance(v, torch.Tensor) for v in vars(stored).values()))

    def spy_take(self: Spill, name: str, spec: Any) -> Any:
        found = take(self, name, spec)
        if found is not None:
            taken.append(name)
        return found

    monkeypatch.setattr(method_run, "run_sequential", spy_run)
    monkeypatch.setattr(Spill, "put", spy_put)
    monkeypatch.setattr(Spill, "take", spy_take)
    _quantize(model, tmp_path / "out", _options(model))
    assert len(real) == 2
    for index, names in enumerate(real):
        blocks = {n.split(".")[2] for n in names if n.startswith("model.layers.")}
        assert blocks == {str(index)}
    assert len(held) == 14 and not any(held)
    assert len(taken) == 14


def test_activations_past_the_bound_wait_in_a_file_with_the_same_result(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a bound of 0 bytes the activations at every block boundary live in a mapped
    temporary file (every window's tensor a view of one numpy memmap) and the output is the
    in-memory run's, weight for weight."""
    _quantize(model, tmp_path / "memory", _options(model))
    in_memory = _restored(tmp_path / "memory", tmp_path)
    kept: list[Any] = []
    spilled = sequential.spilled

    def spy(*args: Any) -> Any:
        kept.append(spilled(*args))
        return kept[-1]

    monkeypatch.setattr(sequential, "ACTIVATIONS_IN_MEMORY", 0)
    monkeypatch.setattr(sequential, "spilled", spy)
    _quantize(model, tmp_path / "file", _options(model))
    on_file = _restored(tmp_path / "file", tmp_path)
    assert len(kept) == 1 and kept[0] is not None and len(kept[0]) == 9  # 7 fit, 1 held, 1 check
    assert {n for n, t in on_file.items() if not torch.equal(t, in_memory[n])} == set()


def test_a_grid_gptq_cannot_solve_is_rounded_to_nearest(model: Path, tmp_path: Path) -> None:
    """Channels on axis 1 (qparams per input column) are a grid the column-by-column solve
    cannot use: each Linear is rounded to nearest and says why, as docs/calibration.md promises
    for every integer grid, instead of an internal error after the model ran."""
    spec = QSpec(Scheme.SYM, StorageDtype.INT8, PerChannel(1))
    options = dataclasses.replace(_options(model), spec=spec)
    summary = _quantize(model, tmp_path / "o", options)
    linears = [r for r in summary.rows if r.quantized and ".layers." in r.name]
    assert linears and {r.decided_by.method for r in linears if r.decided_by} == {"rtn"}
    assert all("rtn, gptq: GPTQ quantizes per tensor" in r.detail for r in linears), linears


@pytest.mark.parametrize(("guard", "kept"), [(Guard.BOTH, "rtn"), (Guard.DOMAIN, "rtn"),
                                             (Guard.NONE, "gptq")])  # fmt: skip
def test_no_held_out_rows_is_no_verdict_and_rounds_to_nearest(
    tmp_path: Path, guard: Guard, kept: str
) -> None:
    """A Linear no held-out window reached has nothing to judge GPTQ on but the rows it was
    fitted to (where it always wins): the guard gives no verdict and rounds to nearest, saying
    so; --guard none keeps GPTQ unchecked as ever."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(8, 32, generator=gen)
    x = torch.randn(256, 32, generator=gen) @ torch.randn(32, 32, generator=gen)
    fit = (2.0 / x.shape[0]) * (x.T @ x)
    spill = Spill(tmp_path)
    try:
        policy = method.GptqPolicy({}, Calibration(guard=guard), spill, False)
        hessians = {"fit": fit, "held": None, "check": fit}
        _, _, chosen = policy._choose(w, method.Target(SPEC, torch.float32), hessians)
    finally:
        spill.close()
    assert chosen.method == kept, chosen
    assert (kept == "rtn") == ("no verdict" in chosen.note), chosen


def test_a_blocks_hessians_are_freed_once_solved(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory held past a block's solve: where each block's weights load and before each of
    pass 2's windows, the live Hessians are counted (gc). Each Linear's three are let go once
    it is solved and the probe before pass 2, so none outlives the solve (they were all kept,
    3 per Linear, through pass 2 and the next block's load)."""
    counts: list[int] = []

    def live() -> int:
        return sum(type(o) is gptq.Hessian for o in gc.get_objects())  # no __class__ lookups

    real_load, real_quantize = blocks.load_module, method.GptqPolicy.quantize
    solved: list[bool] = []

    def loading(*args: Any, **kwargs: Any) -> Any:
        counts.append(live())
        solved.clear()
        return real_load(*args, **kwargs)

    def quantize(self: Any, prefix: str, probe: Any) -> None:
        assert live() > 0  # pass 1 gathered them (the count can see them)
        real_quantize(self, prefix, probe)
        solved.append(True)

    real_forward = transformers.models.llama.modeling_llama.LlamaDecoderLayer.forward

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if solved:  # pass 2
            counts.append(live())
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(sequential, "load_module", loading)
    monkeypatch.setattr(method.GptqPolicy, "quantize", quantize)
    monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaDecoderLayer, "forward",
                        forward)  # fmt: skip
    _quantize(model, tmp_path / "o", _options(model))
    assert len(counts) > 2 and counts == [0] * len(counts), counts
