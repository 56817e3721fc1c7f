"""The model-level verdict at the end of `quantize --method` (engine/methods/verdict.py): the KL of
the chosen result and of round to nearest against the float model, on the held-out windows and
on the check text, equal a straightforward reference (both models loaded whole by transformers,
the decoder blocks' Linears replaced by the weights the outputs restore, KL on every scored
position); the `--max-kl-ratio` gate fails a run (exit 3) whose result loses to rounding, and
passes one the guard brought back to rounding."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from qtool import api  # noqa: E402
from qtool.calibration import Calibration, Guard, Method  # noqa: E402
from qtool.engine.methods import run as method_run  # noqa: E402
from qtool.engine.plan import QuantizeOptions  # noqa: E402
from qtool.numerics import gptq  # noqa: E402
from qtool.numerics.logits import kl_divergence  # noqa: E402
from tests.conftest import Invoke  # noqa: E402
from tests.engine.test_gptq_pass import CTX, SPEC, _losing, calibration_model  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return calibration_model(tmp_path_factory.mktemp("model-kl"))


def _options(model: Path, **calibration: Any) -> QuantizeOptions:
    root = model.parent
    data = Calibration(
        texts=(root / "calib.txt",), tokens=16 * CTX, ctx=CTX, check_texts=(root / "check.txt",)
    )
    return QuantizeOptions(SPEC, calibration=dataclasses.replace(data, **calibration))


def _block_weights(out: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The decoder blocks' Linear weights as a consumer restores the output (qtool dequantize)."""
    target = tmp / f"{out.name}.restored"
    api.dequantize(out, target, force=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(target.glob("*.safetensors")):
        tensors |= {k: v.float() for k, v in load_file(f).items()}
    return {k: v for k, v in tensors.items() if ".layers." in k and k.endswith("proj.weight")}


def _reference_kl(model: Path, weights: dict[str, torch.Tensor], windows: list[list[int]]) -> float:
    """Mean KL(float || model with `weights`) per scored position (all but each window's last),
    both models whole, in transformers."""
    float_model = transformers.LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    other = transformers.LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    state = other.state_dict()
    assert set(weights) <= set(state) and sum(k.endswith("proj.weight") for k in weights) == 14
    other.load_state_dict({**state, **weights})
    total, scored = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            lf = torch.log_softmax(float_model(input_ids=ids).logits[0, :-1], dim=-1)
            lq = torch.log_softmax(other(input_ids=ids).logits[0, :-1], dim=-1)
            total += float(kl_divergence(lf, lq).double().sum())
            scored += len(w) - 1
    return total / scored


@pytest.mark.parametrize("which", [Method.GPTQ, Method.AWQ])
def test_the_figures_equal_whole_models_run_by_transformers(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: Method
) -> None:
    """The chosen result's KL (the blocks as the method's output restores them) and rounding's
    (the blocks of a plain run of the same spec) on the held-out and check windows the run
    used; AWQ's folds change the norms, which the reference takes from its output too."""
    seen: list[dict[str, list[list[int]]]] = []
    run = method_run.run_sequential

    def spy(model_: Any, reader: Any, streams: Any, *args: Any, **kw: Any) -> None:
        seen.append({k: list(v) for k, v in streams.items()})
        run(model_, reader, streams, *args, **kw)

    monkeypatch.setattr(method_run, "run_sequential", spy)
    out = tmp_path / "method"
    summary = api.quantize(model, out, _options(model, method=which), device="cpu", force=True)
    plain = tmp_path / "plain"
    api.quantize(model, plain, QuantizeOptions(SPEC), device="cpu", force=True)
    chosen_weights = _block_weights(out, tmp_path)
    if which is Method.AWQ:  # the folded norms are part of the method's model
        restored = tmp_path / f"{out.name}.restored"
        for f in restored.glob("*.safetensors"):
            chosen_weights |= {
                k: v.float() for k, v in load_file(f).items() if "layernorm" in k
            }  # fmt: skip
    rounding_weights = _block_weights(plain, tmp_path)
    figures = {k.stream: k for k in summary.model_kl}
    assert set(figures) == {"held-out", "check text"}
    for stream, label in (("held", "held-out"), ("check", "check text")):
        windows = seen[0][stream]
        assert windows and figures[label].tokens == sum(len(w) - 1 for w in windows)
        got = figures[label]
        want_chosen = _reference_kl(model, chosen_weights, windows)
        want_rounding = _reference_kl(model, rounding_weights, windows)
        assert got.rounding > 0 and got.chosen > 0
        assert got.chosen == pytest.approx(want_chosen, rel=1e-3, abs=1e-7)
        assert got.rounding == pytest.approx(want_rounding, rel=1e-3, abs=1e-7)


def _cli(model: Path, out: Path, *more: str) -> list[str]:
    root = model.parent
    return ["quantize", str(model), "--method", "gptq", "--text", str(root / "calib.txt"),
            "--check-text", str(root / "check.txt"), "--tokens", str(16 * CTX), "--ctx",
            str(CTX), "--dtype", "int4", "--group-size", "16", "-o", str(out), "--force",
            *more]  # fmt: skip


def test_the_gate_fails_a_result_that_loses_to_rounding(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, invoke: Invoke
) -> None:
    """GPTQ made to lose and kept unchecked (--guard none): its model KL is above rounding's on
    both texts and --max-kl-ratio 1 fails the run, exit 3, naming each text; the table and
    JSON give the figures. Under the default guard every Linear falls back to rounding, the
    two figures are equal, and the same gate passes."""
    monkeypatch.setattr(gptq, "gptq_quantize", _losing)
    rc, stdout, err = invoke(*_cli(model, tmp_path / "a", "--guard", "none",
                                   "--max-kl-ratio", "1"))  # fmt: skip
    assert rc == 3, err
    said = " ".join(stdout.split())  # lines wrap at the terminal's width
    assert "model KL (nats/token): held-out windows of calib.txt, " in said
    assert "(rounding " in said and "check text check.txt, " in said
    assert "gate: FAILED" in said and "model KL on the held-out windows" in said
    assert "model KL on the check text" in said
    rc, stdout, err = invoke(*_cli(model, tmp_path / "b", "--guard", "none",
                                   "--max-kl-ratio", "1", "--json"))  # fmt: skip
    assert rc == 3, err
    doc = json.loads(stdout)
    kl = {k["stream"]: k for k in doc["model_kl"]}
    assert all(k["kl"] > k["rounding_kl"] and k["ratio"] > 1 for k in kl.values())
    violations = [v for v in doc["gate"]["violations"] if v["metric"] == "model_kl_ratio"]
    assert len(violations) == 2 and doc["gate"]["bounds"]["max_kl_ratio"] == 1
    rc, stdout, err = invoke(*_cli(model, tmp_path / "c", "--max-kl-ratio", "1", "--json"))
    assert rc == 0, err
    doc = json.loads(stdout)
    assert all(k["ratio"] == 1.0 for k in doc["model_kl"]) and doc["gate"]["passed"]


def test_the_gate_without_a_method_is_a_usage_error(
    model: Path, tmp_path: Path, invoke: Invoke
) -> None:
    rc, stdout, err = invoke("quantize", str(model), "-o", str(tmp_path / "o"),
                             "--max-kl-ratio", "1")  # fmt: skip
    assert (rc, stdout) == (2, "") and "goes only with --method" in err, err
    rc, _, err = invoke(*_cli(model, tmp_path / "o", "--max-kl-ratio", "0"))
    assert rc == 2 and "must be above 0" in err, err


def test_rounding_everywhere_gives_equal_figures(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard rejecting every Linear: the chosen stream and the rounding stream run the same
    weights, so the figures are equal (the two streams are computed alike)."""
    monkeypatch.setattr(gptq, "gptq_quantize", _losing)
    summary = api.quantize(
        model, tmp_path / "o", _options(model, guard=Guard.BOTH), device="cpu", force=True
    )
    assert summary.model_kl and all(k.chosen == k.rounding for k in summary.model_kl)


def test_the_streams_copies_past_the_bound_wait_in_a_file_with_the_same_figures(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The float and rounding copies of the held-out and check activations are mapped to a
    temporary file past ACTIVATIONS_IN_MEMORY (here 0), as the pass's own are; the figures do
    not change."""
    from qtool.engine.methods import verdict

    in_memory = api.quantize(model, tmp_path / "a", _options(model), device="cpu", force=True)
    mapped: list[bool] = []
    spilled = verdict.spilled

    def spy(*args: Any) -> Any:
        found = spilled(*args)
        mapped.append(found is not None)
        return found

    monkeypatch.setattr(verdict, "ACTIVATIONS_IN_MEMORY", 0)
    monkeypatch.setattr(verdict, "spilled", spy)
    on_file = api.quantize(model, tmp_path / "b", _options(model), device="cpu", force=True)
    assert mapped == [True]
    assert on_file.model_kl == in_memory.model_kl and len(on_file.model_kl) == 2
