"""Issue 17: compressed-tensors configs read exactly as compressed-tensors reads them, scales
validated, patterns from files bounded, module names written so they read literally."""

from __future__ import annotations

import json
import re
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from qtool import patterns
from qtool.cli import app
from qtool.formats.compressed_tensors import coerce as ct_coerce
from qtool.formats.compressed_tensors.selection import literal_target

SAMPLES = Path(__file__).parents[2] / "sample_weights"
CT = ("--format", "compressed-tensors")

VALUES: dict[str, list[object]] = {
    "num_bits": [4, "4", 4.0, 4.5, "4.0", True, " 4 ", "+4", "1_0", "0x4", "٤", None, "four"],
    "symmetric": [True, False, "false", "False", "0", "1", 0, 1, 2, 0.0, 1.0, 0.5, "no", "off",
                  "n", "t", "yes", "on", None, "", " true", "1.0", []],
    "group_size": [128, "128", 128.0, -1, -2, 0, None, True, 1.5, -1.5],
    "strategy": ["group", "GROUP", "Channel", " channel", 1, None, "tensor", "token", "block"],
    "type": ["int", "INT", "float", 1, None],
    "dynamic": [False, True, "false", 0, 1, "local", None, 0.0],
    "actorder": [None, False, True, "weight", "static", "WEIGHT", "group", 0, "foo"],
    "scale_dtype": [None, "bfloat16", "torch.float16", "foo", 3],
    "observer_kwargs": [{}, None, []],
}  # fmt: skip


def _reference(w: dict[str, object]) -> dict[str, object] | None:
    from compressed_tensors.quantization import QuantizationArgs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            a = QuantizationArgs.model_validate(w)
        except Exception:  # ValidationError, and the TypeError its validators can raise
            return None
    strategy = a.strategy.value if hasattr(a.strategy, "value") else a.strategy
    kind = a.type if isinstance(a.type, str) else a.type.value
    return {"num_bits": a.num_bits, "symmetric": a.symmetric, "group_size": a.group_size,
            "strategy": strategy, "type": kind}  # fmt: skip


def _ours(w: dict[str, object]) -> dict[str, object] | None:
    try:
        a = ct_coerce.quantization_args(w)
    except ValueError:
        return None
    return {k: a[k] for k in ("num_bits", "symmetric", "group_size", "strategy", "type")}


@pytest.mark.parametrize("field", sorted(VALUES))
def test_coercions_match_compressed_tensors(field: str) -> None:
    pytest.importorskip("compressed_tensors")
    for value in VALUES[field]:
        for base in ({}, {"group_size": 128}, {"strategy": "channel"}):
            w = {**base, field: value}
            assert _ours(w) == _reference(w), (w, _ours(w), _reference(w))


def _export(tmp_path: Path, *args: str) -> Path:
    out = tmp_path / "q"
    result = CliRunner().invoke(app, ["quantize", str(SAMPLES / "tiny-llama"), *CT, "-o", str(out),
                                      *args])  # fmt: skip
    assert result.exit_code == 0, result.stderr
    return out


def _edit_config(out: Path, edit: dict[str, object]) -> None:
    doc = json.loads((out / "config.json").read_text())
    doc["quantization_config"]["config_groups"]["group_0"]["weights"].update(edit)
    (out / "config.json").write_text(json.dumps(doc))


def _dequantize(out: Path) -> tuple[int, str, dict[str, torch.Tensor]]:
    target = out.parent / "r.safetensors"
    target.unlink(missing_ok=True)
    result = CliRunner().invoke(app, ["dequantize", str(out), "-o", str(target)])
    tensors = load_file(target) if result.exit_code == 0 else {}
    return result.exit_code, result.stderr, tensors


@pytest.mark.parametrize("spelling", ["false", 0, "no", "FALSE"])
def test_symmetric_false_spelled_otherwise_is_asymmetric(tmp_path: Path, spelling: object) -> None:
    out = _export(tmp_path, "--scheme", "asym")
    _, _, reference = _dequantize(out)
    _edit_config(out, {"symmetric": spelling, "num_bits": "8"})
    code, err, tensors = _dequantize(out)
    assert code == 0, err
    assert all(torch.equal(tensors[k], reference[k]) for k in reference)


def test_a_zero_point_under_a_symmetric_scheme_is_an_error(tmp_path: Path) -> None:
    out = _export(tmp_path, "--scheme", "asym")
    _edit_config(out, {"symmetric": True})
    code, err, _ = _dequantize(out)
    assert code == 1 and "weight_zero_point is stored but the scheme says symmetric" in err, err


@pytest.mark.parametrize("bad", ["nan", "inf", "zero", "negative", "huge", "int32"])
def test_scales_are_validated_naming_the_tensor(tmp_path: Path, bad: str) -> None:
    out = _export(tmp_path)
    tensors = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight_scale"
    scale = tensors[name].clone()
    if bad == "int32":
        scale = torch.zeros_like(scale, dtype=torch.int32)
    else:
        scale[0, 0] = {"nan": float("nan"), "inf": float("inf"), "zero": 0.0, "negative": -1.0,
                       "huge": 3e38}[bad]  # fmt: skip
    tensors[name] = scale
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    code, err, _ = _dequantize(out)
    assert code == 1 and "model.layers.0.mlp.up_proj" in err and "weight_scale" in err, err
    assert "internal error" not in err


def test_a_strategy_that_disagrees_with_the_scales_is_a_clear_error(tmp_path: Path) -> None:
    out = _export(tmp_path, "--dtype", "int4", "--group-size", "32")
    _edit_config(out, {"strategy": "channel", "group_size": None})
    code, err, _ = _dequantize(out)
    assert code == 1 and "strategy channel" in err and "internal error" not in err, err


def test_a_config_nested_200000_deep_is_a_clear_error(tmp_path: Path) -> None:
    out = _export(tmp_path)
    (out / "config.json").write_text('{"quantization_config": ' + "[" * 200_000)
    for command in ("inspect", "dequantize"):
        result = CliRunner().invoke(app, [command, str(out)])
        assert result.exit_code == 1 and "internal error" not in result.stderr, result.stderr


def test_a_catastrophic_pattern_in_ignore_finishes_fast(tmp_path: Path) -> None:
    out = _export(tmp_path)
    doc = json.loads((out / "config.json").read_text())
    doc["quantization_config"]["ignore"] = ["lm_head", "re:(.+)+X"]
    (out / "config.json").write_text(json.dumps(doc))
    started = time.monotonic()
    result = CliRunner().invoke(app, ["inspect", str(out)])
    assert time.monotonic() - started < 20
    assert result.exit_code == 1 and "backtracks catastrophically" in result.stderr, result.stderr


def test_a_catastrophic_recipe_pattern_finishes_fast(tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[rule]]\nmatch = "re:(.+)+X"\nkeep = "hostile"\n')
    started = time.monotonic()
    args = ["quantize", str(SAMPLES / "tiny-llama"), *CT, "--recipe", str(recipe)]
    result = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "o"), "--dry-run"])
    assert time.monotonic() - started < 20
    assert result.exit_code != 0 and "backtracks catastrophically" in result.stderr, result.stderr


def test_bounded_matching_agrees_with_re() -> None:
    for pattern, name in [(r".*\.mlp\..*", "model.layers.0.mlp.up_proj"), (r"lm_head", "lm")]:
        assert patterns.matches(pattern, name) == (re.match(pattern, name) is not None)
    with pytest.raises(patterns.PatternError):
        patterns.compiled("a" * 2_000)


@pytest.mark.parametrize("module", ["re:.*", "Linear", "re:model\\..*"])
def test_module_names_are_written_so_compressed_tensors_reads_them_literally(module: str) -> None:
    match = pytest.importorskip("compressed_tensors.utils.match")
    target = literal_target(module)
    assert match.match_name(module, target)
    for other in ("model.layers.0.mlp.up_proj", "lm_head", "re:x", "Linear2"):
        assert not match.match_name(other, target)


def test_a_module_named_like_a_regex_goes_into_ignore_escaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qtool.formats.compressed_tensors import modules

    def undecided(*_args: object) -> modules.Linears:  # transformers knows no such module
        raise modules.Undecided("transformers is not installed")

    monkeypatch.setattr(modules, "built_linears", undecided)  # the rules keep the name as is
    src = tmp_path / "m"
    shutil.copytree(SAMPLES / "tiny-llama", src)
    tensors = load_file(src / "model.safetensors")
    tensors["re:.*.lm_head.weight"] = torch.randn(128, 64, dtype=torch.bfloat16)  # kept float
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "q"
    result = CliRunner().invoke(app, ["quantize", str(src), *CT, "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert "re:.*.lm_head" not in ignore and literal_target("re:.*.lm_head") in ignore
    assert CliRunner().invoke(app, ["inspect", str(out)]).exit_code == 0


def test_exclude_everything_is_refused_and_nothing_appears(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["quantize", str(SAMPLES / "tiny-llama"), *CT, "-o",
                                      str(tmp_path / "q"), "--exclude", "*"])  # fmt: skip
    assert result.exit_code == 1 and "no Linear layer is left to quantize" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_empty_config_groups_written_by_another_tool_reads_as_float(tmp_path: Path) -> None:
    """compressed-tensors accepts `config_groups: {}`; so does qtool (nothing is quantized)."""
    src = tmp_path / "m"
    shutil.copytree(SAMPLES / "tiny-llama", src)
    doc = json.loads((src / "config.json").read_text())
    doc["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "config_groups": {},
        "quantization_status": "compressed",
        "format": "dense",
    }
    (src / "config.json").write_text(json.dumps(doc))
    result = CliRunner().invoke(app, ["inspect", str(src)])
    assert result.exit_code == 0, result.stderr
