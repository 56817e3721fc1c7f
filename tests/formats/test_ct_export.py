"""`qtool quantize --format compressed-tensors` end to end through the CLI and the one quantize
loop (no transformers needed: tests/interop/test_interop.py loads the exports), and reading the
exports back with inspect, dequantize and compare."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool.formats.compressed_tensors.codec import encode_weight
from qtool.formats.registry import open_reader
from qtool.spec import PerGroup, QSpec, Scheme, StorageDtype
from tests.conftest import Invoke

CT = ("--format", "compressed-tensors")


@pytest.fixture
def llama(samples: Path) -> Path:
    return samples / "tiny-llama"


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if "qtool-tmp" in p.name or "qtool-old" in p.name]


def test_export_is_a_model_directory_with_the_encoder_bytes(
    invoke: Invoke, llama: Path, tmp_path: Path
) -> None:
    out = tmp_path / "w4"
    code, _, err = invoke("quantize", str(llama), *CT, "--dtype", "int4", "--group-size", "32",
                          "-o", str(out))  # fmt: skip
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        ".qtool-export.json",  # what qtool wrote, so that --force replaces only that
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert (out / "generation_config.json").read_bytes() == (
        llama / "generation_config.json"
    ).read_bytes()
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["ignore"] == ["lm_head"] and q["quantization_status"] == "compressed"
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    stored = load_file(out / "model.safetensors")
    weights = load_file(llama / "model.safetensors")
    spec = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32))
    for name in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.k_proj"):
        # the encoder rounds scales to bf16 before computing the codes: so must the loop
        expected = encode_weight(weights[f"{name}.weight"], spec).tensors
        for local, t in expected.items():
            assert torch.equal(stored[f"{name}.{local}"], t), f"{name}.{local}"
    assert torch.equal(stored["lm_head.weight"], weights["lm_head.weight"])
    assert leftovers(tmp_path) == []


def test_export_reads_back_with_inspect_dequantize_and_compare(
    invoke: Invoke, llama: Path, tmp_path: Path
) -> None:
    out = tmp_path / "w8"
    assert invoke("quantize", str(llama), *CT, "-o", str(out))[0] == 0
    code, stdout, err = invoke("inspect", str(out))
    assert code == 0 and "compressed-tensors" in stdout and "sym int8 axis 0" in stdout
    assert "14 quantized modules; ignore (kept float): lm_head" in stdout
    assert "warning" not in err  # what the config says is information, not a warning
    code, stdout, _ = invoke("inspect", str(out), "--json")
    doc = json.loads(stdout)
    assert (doc["quantized_modules"], doc["ignore"], doc["notes"]) == (14, ["lm_head"], [])
    code, _, err = invoke("compare", str(llama), str(out), "--min-sqnr", "35")
    assert code == 0, err
    restored = tmp_path / "restored.safetensors"
    assert invoke("dequantize", str(out), "-o", str(restored))[0] == 0
    reader = open_reader(out)
    try:
        expected = {n: reader.values(n) for n in reader.names}
    finally:
        reader.close()
    got = load_file(restored)
    assert set(got) == set(load_file(llama / "model.safetensors"))
    assert all(torch.equal(got[n], expected[n]) for n in got)


def test_sharded_input_keeps_shards_and_rewrites_the_index(
    invoke: Invoke, llama: Path, tmp_path: Path
) -> None:
    src = tmp_path / "sharded"
    src.mkdir()
    shutil.copy(llama / "config.json", src / "config.json")
    tensors = load_file(llama / "model.safetensors")
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    parts: list[dict[str, torch.Tensor]] = [{}, {}]
    for key, t in tensors.items():
        parts[1 if key.startswith("model.layers.1.") else 0][key] = t
    weight_map = {}
    for name, part in zip(names, parts, strict=True):
        save_file(part, src / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    code, _, err = invoke("quantize", str(src), *CT, "-o", str(out))
    assert code == 0, err
    written = json.loads((out / "model.safetensors.index.json").read_text())
    held = {n: shard for shard in names for n in load_file(out / shard)}
    assert written["weight_map"] == held
    assert "model.layers.1.mlp.up_proj.weight_packed" in held
    assert "model.layers.1.mlp.up_proj.weight" not in held
    data = sum((out / s).stat().st_size for s in names)
    assert 0 < written["metadata"]["total_size"] < data


def test_single_file_needs_config(invoke: Invoke, llama: Path, tmp_path: Path) -> None:
    weights = llama / "model.safetensors"
    code, _, err = invoke("quantize", str(weights), *CT, "-o", str(tmp_path / "a"))
    assert code == 2 and "--config PATH" in err
    out = tmp_path / "b"
    code, _, err = invoke("quantize", str(weights), *CT, "--config", str(llama / "config.json"),
                          "-o", str(out))  # fmt: skip
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        ".qtool-export.json",
        "config.json",
        "model.safetensors",
    ]


def test_output_directory_is_required(invoke: Invoke, llama: Path) -> None:
    code, _, err = invoke("quantize", str(llama), *CT)
    assert code == 2 and "-o" in err


def test_group_size_that_breaks_k_is_refused_before_writing(
    invoke: Invoke, llama: Path, tmp_path: Path
) -> None:
    out = tmp_path / "g128"
    code, _, err = invoke("quantize", str(llama), *CT, "--dtype", "int4", "--group-size", "128",
                          "-o", str(out))  # fmt: skip
    assert code == 1
    assert "model.layers.0.mlp.gate_proj.weight (K=64, G=128)" in err
    assert " and 9 more " in err  # the first three named, the rest counted
    assert "--group-fallback channel|keep" in err
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("fallback", ["channel", "keep"])
def test_group_fallback(invoke: Invoke, llama: Path, tmp_path: Path, fallback: str) -> None:
    out = tmp_path / fallback
    code, _, err = invoke("quantize", str(llama), *CT, "--dtype", "int4", "--group-size", "128",
                          "--group-fallback", fallback, "-o", str(out))  # fmt: skip
    assert code == 0, err
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    down = ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    if fallback == "channel":  # exact names first, the Linear catch-all last
        assert q["config_groups"]["group_0"]["targets"] == down
        assert q["config_groups"]["group_1"]["weights"]["strategy"] == "channel"
        assert q["ignore"] == ["lm_head"]
    else:
        assert len(q["config_groups"]) == 1
        assert len(q["ignore"]) == 13 and not set(down) & set(q["ignore"])


def test_existing_output_is_kept_unless_forced(invoke: Invoke, llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    code, _, err = invoke("quantize", str(llama), *CT, "-o", str(out))
    assert code == 1 and "--force" in err and (out / "mine.txt").exists()
    # --force replaces only a previous qtool export: a file qtool did not write is never lost
    code, _, err = invoke("quantize", str(llama), *CT, "-o", str(out), "--force")
    assert code == 1 and "mine.txt would be lost" in err, err
    assert (out / "mine.txt").read_text() == "keep me"
    (out / "mine.txt").unlink()
    assert invoke("quantize", str(llama), *CT, "-o", str(out))[0] == 0  # empty: no force needed
    assert invoke("quantize", str(llama), *CT, "-o", str(out), "--force")[0] == 0
    assert (out / "model.safetensors").exists()
    assert leftovers(tmp_path) == []


def test_a_failure_leaves_no_directory(invoke: Invoke, llama: Path, tmp_path: Path) -> None:
    tensors = load_file(llama / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(tensors, llama / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    code, _, err = invoke("quantize", str(llama), *CT, "-o", str(out))
    assert code == 1 and "NaN" in err
    assert not out.exists() and leftovers(tmp_path) == []


def test_an_export_is_not_quantized_again(invoke: Invoke, llama: Path, tmp_path: Path) -> None:
    assert invoke("quantize", str(llama), *CT, "-o", str(tmp_path / "once"))[0] == 0
    code, _, err = invoke("quantize", str(tmp_path / "once"), *CT, "-o", str(tmp_path / "twice"))
    assert code == 1 and "already quantized" in err


def test_dry_run_shows_plan_and_ignore_and_writes_nothing(
    invoke: Invoke, llama: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    code, stdout, err = invoke("quantize", str(llama), *CT, "--dry-run", "-o", str(out))
    assert code == 0 and "model.layers.0.mlp.up_proj.weight" in stdout
    assert "BF16→I32" in stdout and "kept: output head" in stdout
    assert "ignore (Linear layers kept in float): lm_head" in err
    assert not out.exists()
    code, stdout, _ = invoke("quantize", str(llama), *CT, "--dry-run", "--json", "-o", str(out))
    doc = json.loads(stdout)
    assert doc["format"] == "compressed-tensors" and doc["ignore"] == ["lm_head"]


def test_warnings_are_one_line_each(invoke: Invoke, llama: Path, tmp_path: Path) -> None:
    code, _, err = invoke("quantize", str(llama), *CT, "--scheme", "asym", "--dtype", "int4",
                          "--group-size", "16", "--dry-run", "-o", str(tmp_path / "o"))  # fmt: skip
    assert code == 0
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert len(warnings) == 2
    assert "group size 16" in warnings[0] and '"dequantize"' in warnings[1]


@pytest.mark.parametrize(
    ("args", "dense"),
    [
        (("--scheme", "asym"), True),  # transformers' packed path cannot load asymmetric
        (("--scheme", "asym", "--dtype", "int4", "--group-size", "32"), True),
        (
            (
                "--scheme",
                "sym",
            ),
            False,
        ),  # loads packed: no key
        (("--scheme", "asym", "--group-size", "128", "--group-fallback", "channel"), False),
    ],
    ids=["asym-int8", "asym-int4", "sym", "asym-mixed"],
)
def test_asymmetric_single_scheme_exports_dequantize_at_load(
    invoke: Invoke, llama: Path, tmp_path: Path, args: tuple[str, ...], dense: bool
) -> None:
    """A single-scheme asymmetric export asks transformers to dequantize at load time (its
    default path raises on asymmetric weights: tests/interop/test_interop.py loads these); a
    mixed one cannot (one group's args for every module) and says no path loads it."""
    out = tmp_path / "o"
    code, _, err = invoke("quantize", str(llama), *CT, *args, "-o", str(out))
    assert code == 0, err
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q.get("dequantize", False) is dense
    assert "CompressedTensorsConfig(dequantize=True)" not in err
    if not dense and "asym" in args:
        assert "no path that loads it correctly" in err


@pytest.mark.parametrize(
    ("args", "message", "exit_code"),
    [
        (("--dtype", "uint8"), "use int8 or int4", 2),  # an option conflict: a usage error
        (("--exclude", "*.0.self_attn.q_proj.weight"), "quantized alike", 1),
    ],
    ids=["uint8", "fused-q-k-v"],
)
def test_plans_vllm_cannot_load_are_refused(
    invoke: Invoke,
    llama: Path,
    tmp_path: Path,
    args: tuple[str, ...],
    message: str,
    exit_code: int,
) -> None:
    out = tmp_path / "out"
    code, _, err = invoke("quantize", str(llama), *CT, *args, "-o", str(out))
    assert code == exit_code and message in err and not out.exists()


def test_gates_apply(invoke: Invoke, llama: Path, tmp_path: Path) -> None:
    code, _, _ = invoke("quantize", str(llama), *CT, "--min-sqnr", "90", "-o", str(tmp_path / "o"))
    assert code == 3


def test_qtool_options_refuse_format_only_flags(invoke: Invoke, llama: Path) -> None:
    code, _, err = invoke("quantize", str(llama / "model.safetensors"), "--group-fallback", "keep")
    assert code == 2 and "--format compressed-tensors" in err


@pytest.mark.parametrize("fmt", [(), CT], ids=["qtool", "compressed-tensors"])
@pytest.mark.parametrize("where", ["in-place", "moved"])
def test_a_compressed_tensors_shard_is_not_quantized_again(
    invoke: Invoke, llama: Path, tmp_path: Path, fmt: tuple[str, ...], where: str
) -> None:
    """By the config beside it, or (moved away from it) by its tensor names."""
    export = tmp_path / "ct"
    assert invoke("quantize", str(llama), *CT, "-o", str(export))[0] == 0
    shard = export / "model.safetensors"
    if where == "moved":
        shard = shard.rename(tmp_path / "moved.safetensors")
    extra = ("--config", str(llama / "config.json")) if fmt else ()
    again = tmp_path / ("again" if fmt else "again.safetensors")
    code, _, err = invoke("quantize", str(shard), *fmt, *extra, "-o", str(again))
    assert code == 1 and "compressed-tensors" in err and "not a float checkpoint" in err
    assert not again.exists()


def test_keep_nonfinite_keeps_the_set_alike_or_refuses(
    invoke: Invoke, llama: Path, tmp_path: Path
) -> None:
    """A NaN tensor kept by --keep-nonfinite is float and in `ignore`, and its size is its own;
    a kept q_proj whose k/v siblings were quantized is refused, and nothing is written."""
    tensors = load_file(llama / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, llama / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    code, stdout, err = invoke("quantize", str(llama), *CT, "--keep-nonfinite", "--json",
                               "-o", str(out))  # fmt: skip
    assert code == 0, err
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["ignore"] == ["lm_head", "model.layers.1.mlp.down_proj"]
    row = next(
        t for t in json.loads(stdout)["tensors"] if t["name"].endswith("1.mlp.down_proj.weight")
    )
    assert (row["quantized"], row["out_dtype"], row["bytes_out"]) == (False, "BF16", 64 * 128 * 2)
    tensors["model.layers.1.self_attn.q_proj.weight"][0, 0] = float("nan")
    save_file(tensors, llama / "model.safetensors", metadata={"format": "pt"})
    code, _, err = invoke(
        "quantize", str(llama), *CT, "--keep-nonfinite", "-o", str(tmp_path / "b")
    )
    assert code == 1 and "quantized alike" in err
    assert not (tmp_path / "b").exists() and leftovers(tmp_path) == []
