"""Issue 19, item 1: each row says what decided its tensor (`decided_by` in the JSON), read from
the plan's Decision: the default selection, a glob, a recipe rule with its file and line, the
budget with its trials, fused siblings, the format, --keep-nonfinite; earlier decisions as
history. The table's detail is read from the same Decision."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from qtool.engine.budget import align_fused
from qtool.engine.decision import Budget, Decision, Quantize, Selection, TensorPlan
from qtool.engine.plan import planned_row
from qtool.io.stformat import TensorEntry
from qtool.report.json import decided_json
from qtool.spec import PerChannel, QSpec, StorageDtype
from tests.conftest import SAMPLES, Invoke

MLP = str(SAMPLES / "mlp.safetensors")
LLAMA = str(SAMPLES / "tiny-llama")


def rows(invoke: Invoke, *args: str) -> dict[str, dict[str, object]]:
    code, stdout, stderr = invoke("quantize", *args, "--json")
    assert code == 0, stderr
    return {r["name"]: r for r in json.loads(stdout)["tensors"]}


def test_default_selection_and_its_keeps(invoke: Invoke) -> None:
    got = rows(invoke, MLP, "--dry-run")
    assert got["head.weight"]["decided_by"] == {
        "action": "quantize", "origin": "default", "spec": "sym int8 axis 0", "history": [],
    }  # fmt: skip
    assert got["head.bias"]["decided_by"] == {
        "action": "keep", "origin": "default", "reason": "1-D (bias/norm)", "history": [],
    }  # fmt: skip
    assert got["head.bias"]["detail"] == "kept: 1-D (bias/norm)"


def test_globs_and_recipe_rules_name_themselves(invoke: Invoke, tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[rule]]\nmatch = "layers.*.weight"\ndtype = "int4"\n')
    got = rows(invoke, MLP, "--dry-run", "--exclude", "embed.*", "--recipe", str(recipe))
    assert got["embed.weight"]["decided_by"] == {
        "action": "keep", "origin": "exclude", "reason": "excluded by --exclude 'embed.*'",
        "rule": {"source": "exclude", "number": 1, "pattern": "embed.*"}, "history": [],
    }  # fmt: skip
    fc1 = got["layers.0.fc1.weight"]["decided_by"]
    assert fc1["origin"] == "recipe" and fc1["spec"] == "sym int4 axis 0"
    assert fc1["rule"] == {
        "source": "recipe", "number": 1, "pattern": "layers.*.weight", "file": str(recipe),
        "line": 1,
    }  # fmt: skip
    assert "[rule 1 'layers.*.weight']" in str(got["layers.0.fc1.weight"]["detail"])


def test_the_budget_shows_its_trials_and_what_it_superseded(invoke: Invoke) -> None:
    got = rows(invoke, MLP, "--dry-run", "--estimate", "--target-sqnr", "30")
    decided = got["layers.0.fc1.weight"]["decided_by"]
    assert decided["origin"] == "budget" and decided["target_sqnr_db"] == 30.0
    assert decided["trials"] and all(
        {"spec", "sqnr_db", "bytes"} == set(t) for t in decided["trials"]
    )
    assert [h["origin"] for h in decided["history"]] == ["default", "budget"]
    assert "trials" not in decided["history"][1]  # claimed by the budget before it measured


def test_the_format_and_the_nonfinite_guard_decide_too(invoke: Invoke, tmp_path: Path) -> None:
    got = rows(invoke, LLAMA, "--format", "compressed-tensors", "-o", str(tmp_path / "ct"),
               "--dry-run")  # fmt: skip
    embed = got["model.embed_tokens.weight"]["decided_by"]
    assert (embed["action"], embed["origin"], embed["format"]) == (
        "keep", "format", "compressed-tensors")  # fmt: skip
    assert embed["reason"] == "embedding" and embed["history"][0]["origin"] == "default"
    bad = tmp_path / "nan.safetensors"
    w = torch.randn(8, 4)
    w[0, 0] = float("nan")
    save_file({"w": w, "v": torch.randn(8, 4)}, bad)
    got = rows(invoke, str(bad), "-o", str(tmp_path / "q.safetensors"), "--keep-nonfinite")
    assert got["w"]["decided_by"]["origin"] == "keep-nonfinite"
    assert got["w"]["decided_by"]["nonfinite"] == 1
    assert got["v"]["decided_by"]["origin"] == "default"


def test_fused_siblings_name_their_set() -> None:
    int8, int4 = QSpec(granularity=PerChannel(0)), QSpec(dtype=StorageDtype.INT4)
    plans = [
        TensorPlan(TensorEntry(f"m.{p}_proj.weight", "F32", (8, 8), 0, 256),
                   Decision(Quantize(int8), Selection()).then(Quantize(s), Budget(20.0)))
        for p, s in (("gate", int4), ("up", int8))
    ]  # fmt: skip
    gate, _ = align_fused(plans, lambda n: "m.{gate_proj,up_proj}" if "proj" in n else None)
    decided = planned_row(gate).decided_by
    assert decided is not None
    doc = decided_json(decided)
    assert (doc["origin"], doc["fused"], doc["spec"]) == (
        "fused-siblings", "m.{gate_proj,up_proj}", "sym int8 axis 0")  # fmt: skip
    assert doc["history"] == [
        {"action": "quantize", "origin": "default", "spec": "sym int8 axis 0"},
        {"action": "quantize", "origin": "budget", "spec": "sym int4 axis 0",
         "target_sqnr_db": 20.0},
    ]  # fmt: skip
