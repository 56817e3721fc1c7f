"""--recipe and --target-sqnr through the real quantize loop: plan, write, sidecar, dequantize."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool import api
from qtool.engine.plan import QuantizeOptions
from qtool.formats.qtool.reader import QtoolReader
from qtool.numerics.metrics import error_stats
from qtool.recipe.file import parse_recipe
from qtool.spec import QSpec, parse_spec_label
from tests.conftest import Invoke

REPO = Path(__file__).resolve().parents[2]
MLP_RECIPE = REPO / "examples" / "mlp.toml"


def _options(target: float | None = None, recipe: Path | None = MLP_RECIPE) -> QuantizeOptions:
    loaded = api.load_recipe(recipe) if recipe is not None else None
    return QuantizeOptions(QSpec(), recipe=loaded, target_sqnr=target)


def _model(path: Path) -> Path:
    """A Gaussian MLP weight (int4 passes a low target) and one with strong outliers."""
    g = torch.Generator().manual_seed(0)
    gauss = torch.randn(64, 256, generator=g)
    spiky = torch.randn(64, 256, generator=g)
    spiky[:, ::128] = 30.0  # one outlier per 128: a 4-bit grid holding it crushes the bulk
    save_file(
        {"mlp.gauss.weight": gauss, "mlp.spiky.weight": spiky, "mlp.bias": gauss[0].clone()}, path
    )
    return path


def _same(a: list[object], b: list[object]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.name, x.detail, x.out_dtype, x.bytes_out) == (
            y.name,
            y.detail,
            y.out_dtype,
            y.bytes_out,
        )  # type: ignore[attr-defined]
        assert x.errors == y.errors  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "target", [None, 15.0, 30.0], ids=["recipe", "recipe+budget15", "recipe+budget30"]
)
def test_dry_run_estimate_equals_the_real_run(samples: Path, target: float | None) -> None:
    src = samples / "mlp.safetensors"
    options = _options(target)
    planned = api.quantize(src, samples / "q.safetensors", options, device="cpu", mode="estimate")
    written = api.quantize(src, samples / "q.safetensors", options, device="cpu")
    _same(planned.rows, written.rows)  # type: ignore[arg-type]
    assert planned.budget_sizes == written.budget_sizes
    assert not planned.dry_run or planned.bytes_out == written.bytes_out


def test_header_only_plan_equals_the_real_run_with_a_recipe(samples: Path) -> None:
    src = samples / "mlp.safetensors"
    plan = api.quantize(src, samples / "q.safetensors", _options(), mode="plan")
    written = api.quantize(src, samples / "q.safetensors", _options(), device="cpu")
    assert plan is not None
    assert [(r.name, r.detail, r.bytes_out) for r in plan.rows] == [
        (r.name, r.detail, r.bytes_out) for r in written.rows
    ]
    assert "[rule 3 're:layers\\.\\d+\\.fc[12]\\.weight']" in plan.rows[6].detail


@pytest.mark.parametrize("target", [None, 20.0], ids=["recipe", "budget20"])
def test_sidecar_records_the_chosen_specs_and_dequantize_restores(
    samples: Path, target: float | None
) -> None:
    src, q, r = samples / "mlp.safetensors", samples / "q.safetensors", samples / "r.safetensors"
    recipe = None if target is not None else MLP_RECIPE
    summary = api.quantize(src, q, _options(target, recipe), device="cpu")
    api.dequantize(q, r)
    original, restored = load_file(src), load_file(r)
    reader = QtoolReader(q)
    try:
        for row in summary.rows:
            spec = reader.quantization(row.name)
            assert (spec is not None) == row.quantized, row.name
            if spec is None:
                assert torch.equal(restored[row.name], original[row.name])
                continue
            assert row.detail.startswith(spec.describe()), row.name
            stats = error_stats(original[row.name].double(), restored[row.name].double())
            assert row.errors is not None
            assert math.isclose(stats.sqnr_db, row.errors.sqnr_db, rel_tol=1e-3), row.name
            if target is not None:
                assert row.errors.sqnr_db >= target
    finally:
        reader.close()


def test_budget_picks_int4_for_gaussian_and_int8_or_float_for_outliers(tmp_path: Path) -> None:
    src = _model(tmp_path / "m.safetensors")
    summary = api.quantize(
        src, tmp_path / "q.safetensors", QuantizeOptions(target_sqnr=18.0), device="cpu"
    )
    rows = {r.name: r for r in summary.rows}
    assert rows["mlp.gauss.weight"].detail.startswith(parse_spec_label("int4 g128 mse").describe())
    assert "int4 g128 mse: " in rows["mlp.gauss.weight"].detail
    assert "(int8 channel: " in rows["mlp.spiky.weight"].detail
    assert rows["mlp.bias"].detail == "kept: 1-D (bias/norm)"
    int8, flt = summary.budget_sizes or (0, 0)
    assert summary.bytes_out < int8 < flt


def test_budget_keeps_float_and_says_by_how_much(tmp_path: Path) -> None:
    src = _model(tmp_path / "m.safetensors")
    summary = api.quantize(
        src, tmp_path / "q.safetensors", QuantizeOptions(target_sqnr=200.0), device="cpu"
    )
    for row in summary.rows[1:]:
        assert not row.quantized
        assert row.detail.startswith("kept float: best ") and row.detail.endswith(" dB < 200")


def test_recipe_rules_are_not_second_guessed_by_the_budget(samples: Path) -> None:
    summary = api.quantize(
        samples / "mlp.safetensors", samples / "q.safetensors", _options(200.0), device="cpu"
    )
    rows = {r.name: r for r in summary.rows}
    assert rows["layers.0.fc1.weight"].detail.startswith("sym int4 group 32 mse")
    assert rows["head.weight"].detail.startswith("sym int8 axis 0")


def test_ladder_comes_from_the_recipe(tmp_path: Path) -> None:
    src = _model(tmp_path / "m.safetensors")
    recipe = tmp_path / "r.toml"
    recipe.write_text('ladder = ["int8 g32"]\n[[rule]]\nmatch = "nothing"\nkeep = "x"\n')
    summary = api.quantize(src, tmp_path / "q.safetensors", _options(10.0, recipe), device="cpu")
    assert "int8 g32: " in summary.rows[1].detail


def test_cli_recipe_errors_are_exit_2_naming_file_line_and_key(
    invoke: Invoke, samples: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rule]]\nmatch = "a"\ngranularity = "channel"\ngroup_size = 32\n')
    code, out, err = invoke(
        "quantize", str(samples / "mlp.safetensors"), "--recipe", str(bad), "--dry-run"
    )
    assert code == 2 and out == ""
    assert str(bad) in err and "line " in err and "group_size" in err
    assert len(err.strip().splitlines()) == 1
    assert not list(samples.glob("*.int8.*"))


def test_cli_missing_recipe_is_exit_2(invoke: Invoke, samples: Path, tmp_path: Path) -> None:
    code, _, err = invoke(
        "quantize", str(samples / "mlp.safetensors"), "--recipe", str(tmp_path / "no.toml")
    )
    assert code == 2 and "no.toml" in err


def test_cli_warns_once_per_unmatched_rule_and_shows_the_rule(
    invoke: Invoke, samples: Path
) -> None:
    code, out, err = invoke(
        "quantize", str(samples / "mlp.safetensors"), "--recipe", str(MLP_RECIPE), "--dry-run"
    )
    assert code == 0
    assert err.count("matches no tensor") == 1
    lines = MLP_RECIPE.read_text().splitlines()
    before = lines[: lines.index('match = "lm_head.*"')]
    head = max(i for i, text in enumerate(before) if text == "[[rule]]")  # the rule's own line
    assert f"line {head + 1}: rule 4 'lm_head.*' matches no tensor" in err
    assert "[rule 1 'embed.*']" in out


def test_cli_target_sqnr_needs_estimate_on_a_dry_run(invoke: Invoke, samples: Path) -> None:
    code, _, err = invoke(
        "quantize", str(samples / "mlp.safetensors"), "--target-sqnr", "30", "--dry-run"
    )
    assert code == 2 and "--estimate" in err


def test_cli_budget_summary_and_json(invoke: Invoke, samples: Path) -> None:
    args = (
        "quantize",
        str(samples / "mlp.safetensors"),
        "--target-sqnr",
        "30",
        "--dry-run",
        "--estimate",
    )
    code, out, _ = invoke(*args)
    assert code == 0 and "vs all-int8" in out and "all-float" in out and "dB >= 30" in out
    code, out, _ = invoke(*args, "--json")
    totals = json.loads(out)["totals"]
    assert totals["bytes_all_int8"] >= totals["bytes_out"] and totals["bytes_all_float"] > 0


def test_gates_still_fail_a_budget_run(invoke: Invoke, samples: Path) -> None:
    code, _, _ = invoke(
        "quantize",
        str(samples / "mlp.safetensors"),
        "--target-sqnr",
        "20",
        "--min-sqnr",
        "60",
        "-o",
        str(samples / "q.safetensors"),
    )
    assert code == 3


def test_parse_recipe_inline_rules_resolve_like_tables() -> None:
    a = parse_recipe('[[rule]]\nmatch = "a.*"\nkeep = "x"\n', "a.toml")
    b = parse_recipe('rule = [{ match = "a.*", keep = "x" }]\n', "a.toml")
    assert [r.action for r in a.rules] == [r.action for r in b.rules]


def test_budget_on_nan_fails_naming_the_tensor_or_keeps_it(invoke: Invoke, tmp_path: Path) -> None:
    x = torch.randn(8, 32)
    x[1, 2] = float("nan")
    src = tmp_path / "nan.safetensors"
    save_file({"w": x, "ok": torch.randn(8, 32)}, src)
    code, _, err = invoke("quantize", str(src), "--target-sqnr", "20")
    assert code == 1 and "'w'" in err and "NaN" in err
    assert not list(tmp_path.glob("nan.int8*"))
    summary = api.quantize(
        src, None, QuantizeOptions(keep_nonfinite=True, target_sqnr=20.0), device="cpu"
    )
    rows = {r.name: r for r in summary.rows}
    assert rows["w"].detail == "kept: 1 NaN/Inf values (--keep-nonfinite)"
    assert "dB >= 20" in rows["ok"].detail


def test_header_only_plan_refuses_a_budget_which_needs_the_data(samples: Path) -> None:
    from qtool.errors import UsageError

    with pytest.raises(UsageError) as info:
        api.quantize(samples / "mlp.safetensors", None, _options(20.0), mode="plan")
    assert info.value.hints == ("estimate",)


@pytest.mark.parametrize("fmt", ["qtool", "compressed-tensors"])
def test_budget_reads_each_tensor_once_and_writes_what_it_measured(
    samples: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """The choosing pass keeps the chosen codes for the writing pass: no tensor is read from
    the input twice, and the output equals a run told each chosen spec by a recipe."""
    from collections import Counter

    from qtool.io.checkpoint import Checkpoint

    src = samples / ("tiny-llama" if fmt != "qtool" else "mlp.safetensors")
    reads: Counter[str] = Counter()
    original = Checkpoint.tensor

    def counting(self: Checkpoint, entry: object) -> torch.Tensor:
        reads[entry.name] += 1  # type: ignore[attr-defined]
        return original(self, entry)  # type: ignore[arg-type]

    monkeypatch.setattr(Checkpoint, "tensor", counting)
    budget_out, told_out = (
        tmp_path / d / ("q.safetensors" if fmt == "qtool" else "") for d in ("budget", "told")
    )
    for out in (budget_out, told_out):
        out.parent.mkdir(exist_ok=True)
    options = QuantizeOptions(QSpec(), target_sqnr=20.0, format=fmt)
    summary = api.quantize(src, budget_out, options, device="cpu")
    chosen = {r.name: r for r in summary.rows if r.quantized}
    assert chosen and all(reads[name] == 1 for name in chosen), reads
    monkeypatch.setattr(Checkpoint, "tensor", original)

    rules = "".join(
        f'[[rule]]\nmatch = "{name}"\n{_keys(row.detail.split(" (")[0])}\n'
        for name, row in chosen.items()
    )
    (tmp_path / "told.toml").write_text(rules)
    told = QuantizeOptions(QSpec(), recipe=api.load_recipe(tmp_path / "told.toml"), format=fmt)
    api.quantize(src, told_out, told, device="cpu")
    for a, b in zip(_outputs(budget_out), _outputs(told_out), strict=True):
        x, y = load_file(a), load_file(b)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), a.name


def _keys(described: str) -> str:
    """Recipe keys of a spec as the table describes it ('sym int4 axis 0 mse')."""
    words = described.split()
    keys = [f'scheme = "{words[0]}"', f'dtype = "{words[1]}"']
    if "group" in words:
        keys.append(f"group_size = {words[words.index('group') + 1]}")
    elif "axis" in words:
        keys.append(f"axis = {words[words.index('axis') + 1]}")
    else:
        keys.append('granularity = "tensor"')
    keys.append(f'range = "{"mse" if "mse" in words else "minmax"}"')
    return "\n".join(keys)


def _outputs(out: Path) -> list[Path]:
    if out.suffix == ".safetensors":
        return [out, out.with_name(out.stem + ".qparams.safetensors")]
    return sorted(out.glob("*.safetensors"))


def test_summary_and_json_name_each_tensors_own_spec(
    invoke: Invoke, samples: Path, tmp_path: Path
) -> None:
    """A rule that changes only the range method still makes the specs per tensor (the summary
    once compared description prefixes; it counts the tensors of each spec written); the JSON
    gives every quantized tensor its spec."""
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[rule]]\nmatch = "*fc1*"\nrange = "mse"\n')
    args = ("quantize", str(samples / "mlp.safetensors"), "--group-size", "32",
            "--recipe", str(recipe), "--dry-run")  # fmt: skip
    code, out, err = invoke(*args)
    assert code == 0, err
    assert "(3 sym int8 group 32, 1 sym int8 group 32 mse)" in out
    code, out, _ = invoke(*args, "--json")
    specs = {t["name"]: t.get("spec") for t in json.loads(out)["tensors"]}
    assert specs["layers.0.fc1.weight"]["range_method"] == "mse"
    assert specs["layers.0.fc2.weight"]["range_method"] == "minmax"
    assert specs["embed.weight"]["granularity"] == {"kind": "group", "size": 32}
    assert specs["head.bias"] is None  # kept
    code, out, _ = invoke("quantize", str(samples / "mlp.safetensors"), "--dry-run")
    assert "(sym int8 axis 0)" in out


def test_excluded_rows_do_not_repeat_the_rule(invoke: Invoke, samples: Path) -> None:
    src = str(samples / "mlp.safetensors")
    code, out, _ = invoke("quantize", src, "--recipe", str(MLP_RECIPE), "--exclude", "head.*",
                          "--dry-run", "--json")  # fmt: skip
    assert code == 0
    detail = {t["name"]: t["detail"] for t in json.loads(out)["tensors"]}["head.weight"]
    assert detail == "kept: excluded by --exclude 'head.*'"


def test_a_ladder_without_a_target_is_reported_unused(
    invoke: Invoke, samples: Path, tmp_path: Path
) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('ladder = ["int8"]\n[[rule]]\nmatch = "embed.*"\nkeep = "x"\n')
    code, _, err = invoke("quantize", str(samples / "mlp.safetensors"), "--recipe", str(recipe),
                          "--dry-run")  # fmt: skip
    assert code == 0 and "its ladder applies only with --target-sqnr" in err


def test_free_space_asks_for_what_the_budget_can_take_not_twice_the_float(
    samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept float (or the dearest candidate) plus the dearest candidate's codes kept between
    the passes: 1 + 1.04/4 of fp32, not 2x (a 64 MiB file on 100 MiB free was refused)."""
    from qtool.engine import run as write  # the run prepares its outputs (write.py folded into it)

    asked: list[int] = []
    real = write.prepared

    def recording(*args: object, **kwargs: object) -> object:
        asked.append(int(args[-1]))  # type: ignore[call-overload]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(write, "prepared", recording)
    src = samples / "mlp.safetensors"
    summary = api.quantize(src, samples / "q.safetensors", _options(20.0, None), device="cpu")
    budget_in = sum(r.bytes_in for r in summary.rows if r.quantized or "kept float" in r.detail)
    assert asked and asked[0] < 1.5 * summary.bytes_in
    assert asked[0] >= budget_in  # at least: every budget tensor kept float


def test_a_budget_with_nothing_to_decide_says_so(
    invoke: Invoke, samples: Path, tmp_path: Path
) -> None:
    recipe = tmp_path / "all.toml"
    recipe.write_text('[[rule]]\nmatch = "*"\ndtype = "int8"\ngranularity = "channel"\n')
    src = str(samples / "mlp.safetensors")
    code, _, err = invoke("quantize", src, "--recipe", str(recipe), "--target-sqnr", "30",
                          "--dry-run", "--estimate")  # fmt: skip
    assert code == 0 and "--target-sqnr decided no tensor" in err
    code, _, err = invoke("quantize", src, "--target-sqnr", "30", "--dry-run", "--estimate")
    assert code == 0 and "decided no tensor" not in err


def test_keep_nonfinite_does_not_read_the_budgets_tensors_again(
    samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget checks NaN/Inf when it measures a tensor; --keep-nonfinite's own pass skips
    the tensors it decided (it once read every one of them a second time)."""
    from collections import Counter

    from qtool.io.checkpoint import Checkpoint

    reads: Counter[str] = Counter()
    original = Checkpoint.tensor

    def counting(self: Checkpoint, entry: object) -> torch.Tensor:
        reads[entry.name] += 1  # type: ignore[attr-defined]
        return original(self, entry)  # type: ignore[arg-type]

    monkeypatch.setattr(Checkpoint, "tensor", counting)
    options = QuantizeOptions(QSpec(), keep_nonfinite=True, target_sqnr=20.0)
    summary = api.quantize(samples / "mlp.safetensors", None, options, device="cpu")
    chosen = [r.name for r in summary.rows if r.quantized]
    assert chosen and all(reads[name] == 1 for name in chosen), reads
