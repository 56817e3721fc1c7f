"""Recipes and the error budget with `--format compressed-tensors`: one config group per spec
chosen, the export's own rules (Linear weights only, signed codes, whole groups, fused
siblings alike) over the recipe's, and the budget's candidates fitted to the format.
tests/interop/test_interop.py loads such exports with transformers and compressed-tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool.engine.budget import align_fused
from qtool.engine.decision import (
    Budget,
    Decision,
    FusedSiblings,
    Keep,
    Quantize,
    Selection,
    TensorPlan,
)
from qtool.formats.compressed_tensors import selection as ct
from qtool.formats.registry import open_reader
from qtool.io.stformat import TensorEntry
from qtool.spec import PerChannel, PerGroup, QSpec, RangeMethod, StorageDtype
from tests.conftest import Invoke

CT = ("--format", "compressed-tensors")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
INT8 = QSpec(granularity=PerChannel(0))
INT4_MSE = QSpec(dtype=StorageDtype.INT4, granularity=PerChannel(0), range_method=RangeMethod.MSE)


@pytest.fixture
def llama(samples: Path) -> Path:
    return samples / "tiny-llama"


def write_recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(text, encoding="utf-8")
    return path


def qconfig(out: Path) -> dict[str, object]:
    doc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert isinstance(doc, dict)
    return doc


def module_bits(out: Path) -> dict[str, tuple[int, str]]:
    """module -> (bits, strategy) as the config's groups say, the first matching group wins
    (specific groups come first, `Linear` last)."""
    found: dict[str, tuple[int, str]] = {}
    stored = load_file(out / "model.safetensors")
    modules = [n.removesuffix(".weight_packed") for n in stored if n.endswith(".weight_packed")]
    groups = qconfig(out)["config_groups"]
    assert isinstance(groups, dict)
    for group in groups.values():
        w = group["weights"]
        for m in modules:
            if m not in found and (m in group["targets"] or group["targets"] == ["Linear"]):
                found[m] = (w["num_bits"], w["strategy"])
    assert set(found) == set(modules)
    return found


def json_rows(stdout: str) -> dict[str, dict[str, object]]:
    return {row["name"]: row for row in json.loads(stdout)["tensors"]}


MIXED = """
[[rule]]
match = "*embed_tokens*"
keep = "embeddings stay float"

[[rule]]
match = "lm_head.*"
keep = "output head stays float"

[[rule]]
match = 're:.*\\.self_attn\\.[qkvo]_proj\\.weight'
scheme = "sym"
dtype = "int8"
granularity = "channel"

[[rule]]
match = 're:.*\\.mlp\\.(gate|up|down)_proj\\.weight'
scheme = "sym"
dtype = "int4"
group_size = 128
range = "mse"
"""


def test_llm_example_recipe_needs_no_fallback(invoke: Invoke, llama: Path, tmp_path: Path) -> None:
    """examples/llm.toml's groups (32 for down_proj, 64 for the others) divide every row: one
    config group per spec, no --group-fallback."""
    out = tmp_path / "llm"
    code, _, err = invoke("quantize", str(llama), *CT, "--recipe", str(EXAMPLES / "llm.toml"),
                          "-o", str(out))  # fmt: skip
    assert code == 0, err
    q = qconfig(out)
    config_groups = q["config_groups"]
    assert isinstance(config_groups, dict)
    groups = list(config_groups.values())
    assert [g["weights"]["group_size"] for g in groups] == [32, 64]
    assert sorted(groups[0]["targets"]) == [f"model.layers.{i}.mlp.down_proj" for i in (0, 1)]
    assert groups[-1]["targets"] == ["Linear"] and q["ignore"] == ["lm_head"]
    assert set(module_bits(out).values()) == {(4, "group")}


def test_mixed_recipe_writes_one_config_group_per_spec(
    invoke: Invoke, llama: Path, tmp_path: Path
) -> None:
    out = tmp_path / "mixed"
    recipe = str(write_recipe(tmp_path, MIXED))
    code, _, err = invoke("quantize", str(llama), *CT, "--recipe", recipe, "-o", str(out))
    assert code == 1  # its MLP rule's groups of 128 are longer than the sample's rows of 64
    assert "model.layers.0.mlp.gate_proj.weight (K=64, G=128)" in err
    assert "--group-fallback channel|keep" in err and not out.exists()
    code, _, err = invoke("quantize", str(llama), *CT, "--recipe", recipe,
                          "--group-fallback", "channel", "-o", str(out))  # fmt: skip
    assert code == 0, err
    q = qconfig(out)
    groups = list(q["config_groups"].values())  # type: ignore[union-attr]
    assert len(groups) == 3 and groups[-1]["targets"] == ["Linear"]  # the catch-all last
    layers = (0, 1)
    assert [sorted(g["targets"]) for g in groups[:2]] == [
        [f"model.layers.{i}.mlp.down_proj" for i in layers],  # K = 128: groups of 128
        [f"model.layers.{i}.mlp.{p}_proj" for i in layers for p in ("gate", "up")],  # fallback
    ]
    assert q["ignore"] == ["lm_head"]
    bits = module_bits(out)
    assert bits["model.layers.0.mlp.up_proj"] == (4, "channel")  # the fallback
    assert bits["model.layers.0.mlp.down_proj"] == (4, "group")
    assert bits["model.layers.1.self_attn.k_proj"] == (8, "channel")
    stored = load_file(out / "model.safetensors")
    assert torch.equal(
        stored["model.embed_tokens.weight"], load_file(llama / "model.safetensors")[
            "model.embed_tokens.weight"]
    )  # fmt: skip


def test_recipe_specs_round_trip_through_dequantize(
    invoke: Invoke, llama: Path, tmp_path: Path
) -> None:
    out, restored = tmp_path / "mixed", tmp_path / "restored.safetensors"
    recipe = write_recipe(tmp_path, MIXED)
    code, _, err = invoke("quantize", str(llama), *CT, "--recipe", str(recipe),
                          "--group-fallback", "channel", "-o", str(out))  # fmt: skip
    assert code == 0, err
    code, stdout, _ = invoke("inspect", str(out), "--json")
    assert code == 0
    specs = {t["name"]: t.get("quantization") for t in json.loads(stdout)["tensors"]}
    assert specs["model.layers.0.mlp.down_proj.weight_packed"]["dtype"] == "int4"
    assert specs["model.layers.0.self_attn.q_proj.weight_packed"]["dtype"] == "int8"
    assert invoke("dequantize", str(out), "-o", str(restored))[0] == 0
    reader = open_reader(out)
    try:
        expected = {n: reader.values(n) for n in reader.names}
    finally:
        reader.close()
    got = load_file(restored)
    assert set(got) == set(expected)
    assert all(torch.equal(got[n], expected[n]) for n in got)


def test_a_rule_compressed_tensors_cannot_store_is_refused(
    invoke: Invoke, llama: Path, tmp_path: Path
) -> None:
    recipe = write_recipe(
        tmp_path, '[[rule]]\nmatch = "*.q_proj.weight"\nscheme = "asym"\ndtype = "uint8"\n'
    )
    code, _, err = invoke("quantize", str(llama), *CT, "--recipe", str(recipe),
                          "-o", str(tmp_path / "out"))  # fmt: skip
    assert code == 2  # the recipe is wrong for this format: a usage error
    line = err.strip().splitlines()[-1]
    assert f"{recipe}: line 1: rule 1 '*.q_proj.weight'" in line
    assert "model.layers.0.self_attn.q_proj.weight" in line
    assert "signed codes" in line
    assert not (tmp_path / "out").exists()


def test_rules_cannot_quantize_what_is_not_a_linear_but_can_name_the_head(
    invoke: Invoke, llama: Path, tmp_path: Path
) -> None:
    recipe = write_recipe(
        tmp_path,
        '[[rule]]\nmatch = "*embed_tokens*"\ndtype = "int8"\n'
        '[[rule]]\nmatch = "lm_head.weight"\ndtype = "int8"\n',
    )
    code, stdout, err = invoke("quantize", str(llama), *CT, "--recipe", str(recipe),
                               "--dry-run", "--json", "-o", str(tmp_path / "out"))  # fmt: skip
    assert code == 0, err
    rows = json_rows(stdout)
    assert rows["model.embed_tokens.weight"]["quantized"] is False
    assert "embedding" in str(rows["model.embed_tokens.weight"]["detail"])
    assert rows["lm_head.weight"]["quantized"] is True  # a rule names the head: quantized


def test_budget_candidates_fit_the_format(invoke: Invoke, llama: Path, tmp_path: Path) -> None:
    """int4 g32 divides every K of the sample: the budget may pick it; a ladder of groups of
    48 (dividing no K) leaves only the candidates compressed-tensors can store."""
    recipe = write_recipe(tmp_path, 'ladder = ["int4 g48 mse", "int8 channel"]\n')
    code, stdout, err = invoke("quantize", str(llama), *CT, "--recipe", str(recipe),
                               "--target-sqnr", "10", "--dry-run", "--estimate", "--json",
                               "-o", str(tmp_path / "out"))  # fmt: skip
    assert code == 0, err
    rows = json_rows(stdout)
    assert "int8 channel: " in str(rows["model.layers.0.mlp.up_proj.weight"]["detail"])


def test_budget_exports_carry_the_chosen_specs(invoke: Invoke, llama: Path, tmp_path: Path) -> None:
    """The recipe fixes the attention at int4; the budget decides the MLP (int8 at 30 dB)."""
    out = tmp_path / "budget"
    recipe = write_recipe(
        tmp_path, '[[rule]]\nmatch = "*.self_attn.*"\ndtype = "int4"\ngranularity = "channel"\n'
    )
    code, stdout, err = invoke("quantize", str(llama), *CT, "--recipe", str(recipe),
                               "--target-sqnr", "30", "--json", "-o", str(out))  # fmt: skip
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["totals"]["bytes_all_int8"] < doc["totals"]["bytes_all_float"]
    bits = module_bits(out)
    assert bits["model.layers.0.self_attn.o_proj"] == (4, "channel")
    assert bits["model.layers.0.mlp.up_proj"] == (8, "channel")
    for name, row in json_rows(stdout).items():
        module = name.removesuffix(".weight")
        if row["quantized"]:
            assert bits[module][0] == (4 if "int4" in str(row["detail"]) else 8), name


def outlier_llama(llama: Path, tmp_path: Path) -> Path:
    """tiny-llama with outliers in layer 0's k_proj, so that it needs more than int4."""
    copy = tmp_path / "outlier-llama"
    shutil.copytree(llama, copy)
    tensors = load_file(copy / "model.safetensors")
    k = tensors["model.layers.0.self_attn.k_proj.weight"].float()
    k[:, 0] = 8 * k.abs().max()
    tensors["model.layers.0.self_attn.k_proj.weight"] = k.to(torch.bfloat16)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_budget_aligns_the_siblings_vllm_fuses(invoke: Invoke, llama: Path, tmp_path: Path) -> None:
    src, out = outlier_llama(llama, tmp_path), tmp_path / "out"
    code, stdout, err = invoke("quantize", str(src), *CT, "--target-sqnr", "20", "--json",
                               "-o", str(out))  # fmt: skip
    assert code == 0, err
    rows = json_rows(stdout)
    layer0 = "model.layers.0.self_attn"
    details = {p: str(rows[f"{layer0}.{p}_proj.weight"]["detail"]) for p in "qkv"}
    assert "int8" in details["k"] and "aligned" not in details["k"]
    for p in "qv":
        assert "int8" in details[p] and "aligned with its fused siblings" in details[p], p
    assert "int4" in str(rows["model.layers.1.self_attn.q_proj.weight"]["detail"])
    bits = module_bits(out)
    assert {bits[f"{layer0}.{p}_proj"] for p in "qkv"} == {(8, "channel")}


def plan(name: str, spec: QSpec | None, budget: bool = True) -> TensorPlan:
    """A tensor the budget decided (kept float when `spec` is None), or a rule fixed."""
    action = Quantize(spec) if spec is not None else Keep("kept float: best 10 dB < 20")
    origin = Budget(20.0) if budget else Selection()
    return TensorPlan(TensorEntry(name, "F32", (64, 64), 0, 64 * 64 * 4), Decision(action, origin))


def key(name: str) -> str | None:
    return ct.fused_key(name.removesuffix(".weight"))


@pytest.mark.parametrize(
    ("q", "k", "v", "expected"),
    [
        (INT4_MSE, INT4_MSE, INT4_MSE, [INT4_MSE] * 3),  # alike already: unchanged
        (INT4_MSE, INT8, INT4_MSE, [INT8] * 3),  # the dearest choice
        (INT4_MSE, None, INT8, [None] * 3),  # kept float is dearest
    ],
    ids=["alike", "dearest", "float"],
)
def test_align_fused_takes_the_dearest_choice(
    q: QSpec | None, k: QSpec | None, v: QSpec | None, expected: list[QSpec | None]
) -> None:
    names = [f"layers.0.attn.{p}_proj.weight" for p in "qkv"]
    plans = [plan(n, s) for n, s in zip(names, (q, k, v), strict=True)]
    aligned = align_fused([*plans, plan("layers.0.attn.o_proj.weight", INT4_MSE)], key)
    assert [p.spec for p in aligned[:3]] == expected
    assert aligned[3].spec == INT4_MSE  # not a fused sibling


def test_align_fused_follows_a_sibling_a_rule_fixed() -> None:
    g32 = QSpec(dtype=StorageDtype.INT4, granularity=PerGroup(32))
    plans = [
        plan("m.gate_proj.weight", g32, budget=False),  # a recipe rule chose it
        plan("m.up_proj.weight", INT8),
    ]
    aligned = align_fused(plans, key)
    assert [p.spec for p in aligned] == [g32, g32]
    assert "aligned with its fused siblings m.{gate_proj,up_proj}" in aligned[1].decision.note


def test_an_aligned_decision_says_why_and_keeps_the_budgets_as_history() -> None:
    """The plan supersedes a decision, never edits it: the budget's own choice stays visible."""
    chosen = [plan(f"m.{p}_proj.weight", s) for p, s in (("gate", INT4_MSE), ("up", INT8))]
    gate, up = align_fused(chosen, key)
    assert up == chosen[1]  # the dearest choice: nothing to align
    assert isinstance(gate.decision.origin, FusedSiblings)
    assert gate.decision.superseded == chosen[0].decision and gate.spec == INT8
    assert gate.decision.describe() == (
        "left to the budget (20 dB): int4 channel mse; "
        "aligned with its fused siblings m.{gate_proj,up_proj}: int8 channel"
    )


def test_a_rule_fixing_one_fused_sibling_leaves_the_budget_the_rest(
    invoke: Invoke, llama: Path, tmp_path: Path
) -> None:
    """The budget's siblings follow the rule's spec; the size references (all-int8, all-float)
    are the format's bytes, computed without its plan checks (they once failed the run after
    the output was written)."""
    recipe = write_recipe(
        tmp_path, '[[rule]]\nmatch = "*q_proj*"\ndtype = "int8"\ngranularity = "channel"\n'
    )
    out = tmp_path / "out"
    code, stdout, err = invoke("quantize", str(llama), *CT, "--recipe", str(recipe),
                               "--target-sqnr", "20", "--json", "-o", str(out))  # fmt: skip
    assert code == 0, err
    rows = json_rows(stdout)
    for p in "kv":
        detail = str(rows[f"model.layers.0.self_attn.{p}_proj.weight"]["detail"])
        assert detail.startswith("sym int8 axis 0") and "aligned" in detail
    totals = json.loads(stdout)["totals"]
    assert totals["bytes_out"] < totals["bytes_all_int8"] < totals["bytes_all_float"]


def test_the_budget_never_checks_the_command_line_spec(
    invoke: Invoke, llama: Path, tmp_path: Path
) -> None:
    """With --target-sqnr the spec options do not apply to the budget's tensors: a group size
    or dtype compressed-tensors refuses is not held against them."""
    for spec in (("--group-size", "48"), ("--scheme", "asym", "--dtype", "uint8")):
        out = tmp_path / "-".join(spec)
        code, _, err = invoke("quantize", str(llama), *CT, *spec, "--target-sqnr", "20",
                              "-o", str(out))  # fmt: skip
        assert code == 0, (spec, err)


def test_a_group_the_export_takes_as_asked_drops_the_fitting_note(
    invoke: Invoke, llama: Path, tmp_path: Path
) -> None:
    code, stdout, err = invoke("quantize", str(llama), *CT, "--dtype", "int4", "--group-size",
                               "128", "--group-fallback", "channel", "--dry-run", "--json",
                               "-o", str(tmp_path / "out"))  # fmt: skip
    assert code == 0, err
    detail = str(json_rows(stdout)["model.layers.0.mlp.down_proj.weight"]["detail"])
    assert detail.startswith("sym int4 group 128") and "per channel" not in detail


def test_an_unsigned_ladder_is_refused_before_any_work_saying_why(
    invoke: Invoke, llama: Path, tmp_path: Path
) -> None:
    """A ladder the format cannot store is a recipe error up front (ab8f8f2), not a run in
    which every budget tensor ends up float."""
    recipe = write_recipe(tmp_path, 'ladder = ["asym uint8 channel"]\n')
    code, stdout, err = invoke("quantize", str(llama), *CT, "--recipe", str(recipe),
                               "--target-sqnr", "20", "--dry-run", "--estimate", "--json",
                               "-o", str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and stdout == "", err
    error = json.loads(err)["error"]  # an error under --json is JSON on stderr
    assert error["code"] == "recipe" and "signed codes" in error["message"]
