"""Issues 18 (item 3) and 19: one `detect(path)` for every command, and model directories in and
out: a plain Hugging Face directory (config.json + one model.safetensors) is quantized into a
directory that mirrors it, and dequantize gives back a float model directory transformers loads."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool import api
from qtool.api import QuantizeOptions
from qtool.errors import InputError, OutputError, UsageError
from qtool.formats.detect import detect
from qtool.formats.registry import open_reader
from qtool.spec import FormatName, PerGroup, QSpec, StorageDtype
from tests.conftest import SAMPLES, Invoke

LLAMA = "tiny-llama"
CT = ("--format", "compressed-tensors")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A copy of the plain tiny Llama directory (config.json, generation_config.json and one
    model.safetensors, no index)."""
    dest = tmp_path / "llama"
    shutil.copytree(SAMPLES / LLAMA, dest)
    return dest


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---- detect: one answer, one order ------------------------------------------------------------


def test_detect_names_every_kind_in_its_priority_order(model: Path, tmp_path: Path) -> None:
    api.quantize(model, tmp_path / "q", QuantizeOptions(), device="cpu")
    api.quantize(SAMPLES / "sharded-mlp", tmp_path / "sq", QuantizeOptions(), device="cpu")
    api.quantize(model, tmp_path / "ct", QuantizeOptions(format=FormatName.COMPRESSED_TENSORS),
                 device="cpu")  # fmt: skip
    expected = {
        SAMPLES / "mlp.safetensors": ("dense", "checkpoint", False),
        SAMPLES / "mlp.pt": ("dense", "checkpoint", False),
        SAMPLES / "sharded-mlp": ("dense", "sharded", False),
        SAMPLES / "sharded-mlp" / "model.safetensors.index.json": ("dense", "sharded", False),
        model: ("dense", "model-directory", False),
        tmp_path / "q": ("qtool", "qtool-directory", True),
        tmp_path / "q" / "model.safetensors": ("qtool", "qtool-file", True),
        tmp_path / "q" / "model.qparams.safetensors": ("qtool", "qtool-sidecar", True),
        tmp_path / "sq": ("qtool", "qtool-sharded", True),
        tmp_path / "ct": ("compressed-tensors", "compressed-tensors", True),
        tmp_path / "ct" / "config.json": ("compressed-tensors", "compressed-tensors", True),
    }
    for path, want in expected.items():
        found = detect(path)
        assert (found.format, found.kind, found.quantized) == want, path


def test_a_directory_is_not_called_sharded(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        save_file({"w": torch.zeros(2, 2)}, tmp_path / "d" / name)
    with pytest.raises(InputError, match=r"no checkpoint in this directory.*2 found") as err:
        detect(tmp_path / "d")
    assert "sharded" not in str(err.value)


@pytest.mark.parametrize("command", ["inspect", "dequantize", "compare", "quantize"])
@pytest.mark.parametrize("bad", ["fifo", "deep", "big", "dev-zero"])
def test_a_directory_whose_config_cannot_be_read_names_config_json(
    invoke: Invoke, model: Path, tmp_path: Path, command: str, bad: str
) -> None:
    """Any directory, compressed-tensors or not: the error names config.json and says why,
    never "no *.safetensors.index.json" (issue 17, item 4)."""
    api.quantize(model, tmp_path / "ct", QuantizeOptions(format=FormatName.COMPRESSED_TENSORS),
                 device="cpu")  # fmt: skip
    target = tmp_path / ("ct" if command in ("inspect", "dequantize") else "llama")
    config = target / "config.json"
    config.unlink()
    if bad == "fifo":
        os.mkfifo(config)
        why = "FIFO"
    elif bad == "deep":
        config.write_text("[" * 200_000)
        why = "nested more than"
    elif bad == "big":
        config.write_text(" " * 16_000_001 + "{}")
        why = "over"
    else:
        config.symlink_to("/dev/zero")
        why = "symlink"
    args = [command, str(target)]
    if command == "compare":
        args.append(str(model / "model.safetensors"))
    code, stdout, stderr = invoke(*args)
    assert code == 1 and stdout == "" and "config.json" in stderr and why in stderr, stderr
    assert "index.json" not in stderr and "internal error" not in stderr


# ---- a plain model directory, every command ------------------------------------------------


def test_inspect_and_compare_take_a_plain_model_directory(invoke: Invoke, model: Path) -> None:
    code, stdout, stderr = invoke("inspect", str(model), "--json")
    assert code == 0, stderr
    doc = json.loads(stdout)
    assert (doc["kind"], doc["shards"], doc["totals"]["tensors"]) == ("checkpoint", 1, 21)
    for other in (model, model / "model.safetensors"):
        code, stdout, stderr = invoke("compare", str(model), str(other), "--json")
        assert code == 0 and "sharded" not in stderr, stderr
        assert json.loads(stdout)["totals"]["compared"] == 21


def test_quantize_a_model_directory_writes_a_directory_that_mirrors_it(
    model: Path, tmp_path: Path
) -> None:
    summary = api.quantize(model, None, QuantizeOptions(), device="cpu")
    out = tmp_path / "llama.int8"
    assert summary.outputs == [str(out)] and summary.inputs == [str(model)]
    assert _files(out) == [".qtool-export.json", "config.json", "generation_config.json",
                           "model.qparams.safetensors", "model.safetensors"]  # fmt: skip
    written = json.loads((out / "config.json").read_text())  # marked: not a float model
    assert (
        written["qtool"]["model_type"]
        == json.loads((model / "config.json").read_text())["model_type"]
    )
    with pytest.raises(UsageError, match="writes a directory"):
        api.quantize(model, tmp_path / "x.safetensors", QuantizeOptions(), device="cpu")
    # again: refused without --force, replaced with it (a qtool export it recorded)
    with pytest.raises(Exception, match="only when asked"):
        api.quantize(model, None, QuantizeOptions(), device="cpu")
    api.quantize(model, None, QuantizeOptions(), device="cpu", force=True)


def test_dequantize_gives_back_a_model_directory_or_one_file(model: Path, tmp_path: Path) -> None:
    spec = QSpec(dtype=StorageDtype.INT4, granularity=PerGroup(32))
    api.quantize(model, tmp_path / "q", QuantizeOptions(spec), device="cpu")
    summary = api.dequantize(tmp_path / "q", None)
    out = tmp_path / "q.dequantized"
    assert summary.outputs == [str(out)] and summary.sidecars == [
        str(tmp_path / "q" / "model.qparams.safetensors")
    ]
    assert _files(out) == [".qtool-export.json", "config.json", "generation_config.json",
                           "model.safetensors"]  # fmt: skip
    restored = load_file(out / "model.safetensors")
    reader = open_reader(tmp_path / "q")
    try:
        assert sorted(restored) == sorted(reader.names)
        for name, t in restored.items():
            assert torch.equal(t, reader.values(name)), name
    finally:
        reader.close()
    api.dequantize(tmp_path / "q", tmp_path / "one.safetensors")
    assert load_file(tmp_path / "one.safetensors").keys() == restored.keys()
    for inside in (tmp_path / "q" / "one.safetensors", tmp_path / "q"):  # never in the input
        with pytest.raises(OutputError, match="input directory"):
            api.dequantize(tmp_path / "q", inside, force=True)
    assert _files(tmp_path / "q") == _files(out)[:3] + ["model.qparams.safetensors",
                                                        "model.safetensors"]  # fmt: skip


def test_dequantize_a_sharded_compressed_tensors_directory_mirrors_its_shards(
    tmp_path: Path,
) -> None:
    src = tmp_path / "m"
    shutil.copytree(SAMPLES / LLAMA, src)
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for shard, held in shards.items():
        save_file({n: tensors[n] for n in held}, src / shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: s for s, held in shards.items() for n in held}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    ct_options = QuantizeOptions(format=FormatName.COMPRESSED_TENSORS)
    api.quantize(src, tmp_path / "ct", ct_options, device="cpu")
    api.dequantize(tmp_path / "ct", tmp_path / "f")
    out = tmp_path / "f"
    assert _files(out) == [".qtool-export.json", "a.safetensors", "b.safetensors", "config.json",
                           "generation_config.json", "model.safetensors.index.json"]  # fmt: skip
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    written = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert written == index["weight_map"]
    for shard, held in shards.items():
        assert sorted(load_file(out / shard)) == sorted(held)


def test_dequantize_refuses_a_float_checkpoint(model: Path) -> None:
    with pytest.raises(InputError, match="not a quantized file"):
        api.dequantize(model, None)


# ---- compare reads scales as dequantize does (issue 17, item 7) ---------------------------------


@pytest.mark.parametrize("bad", ["int32", "fp8-zero"])
def test_compare_refuses_the_scales_dequantize_refuses(
    invoke: Invoke, model: Path, tmp_path: Path, bad: str
) -> None:
    ct = tmp_path / "ct"
    assert invoke("quantize", str(model), *CT, "-o", str(ct))[0] == 0
    tensors = load_file(ct / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight_scale"
    if bad == "int32":
        tensors[name] = torch.zeros_like(tensors[name], dtype=torch.int32)
    else:
        tensors[name] = (tensors[name] * 1e-30).to(torch.float8_e4m3fn)  # rounds to 0
    save_file(tensors, ct / "model.safetensors", metadata={"format": "pt"})
    code, _, dequantize_err = invoke("dequantize", str(ct), "-o", str(tmp_path / "r.safetensors"))
    assert code == 1 and "model.layers.0.mlp.up_proj" in dequantize_err
    code, stdout, compare_err = invoke("compare", str(model), str(ct))
    assert code == 1 and stdout == ""
    assert compare_err.split(": ", 2)[-1] == dequantize_err.split(": ", 2)[-1]


# ---- the real consumer ----------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("fmt", ["qtool", "compressed-tensors"])
def test_transformers_loads_the_dequantized_directory(
    model: Path, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """quantize DIR, dequantize it: `from_pretrained` loads the float directory, runs, and its
    weights are qtool's dequantization exactly."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers", reason="needs the interop extra")
    spec = QSpec(dtype=StorageDtype.INT4, granularity=PerGroup(32))
    api.quantize(model, tmp_path / "q", QuantizeOptions(spec, format=FormatName(fmt)),
                 device="cpu")  # fmt: skip
    api.dequantize(tmp_path / "q", tmp_path / "f")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "f")
    logits = loaded(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 128) and bool(torch.isfinite(logits).all())
    state = loaded.state_dict()
    reader = open_reader(tmp_path / "q")
    try:
        assert set(reader.names) <= set(state)
        for name in reader.names:
            assert torch.equal(state[name].float(), reader.values(name).float()), name
    finally:
        reader.close()


@pytest.mark.parametrize("fmt", ["qtool", "compressed-tensors"])
@pytest.mark.parametrize("to", ["float16", "float32"])
def test_dequantize_to_a_dtype_gives_every_float_tensor_and_the_config_that_dtype(
    model: Path, tmp_path: Path, fmt: str, to: str
) -> None:
    """--to converts the tensors that were never quantized (norms) too, and config.json says
    the dtype written, so transformers does not cast the model back to the original dtype."""
    api.quantize(model, tmp_path / "q", QuantizeOptions(format=FormatName(fmt)), device="cpu")
    summary = api.dequantize(tmp_path / "q", tmp_path / "f", dtype=to)
    want = {"float16": torch.float16, "float32": torch.float32}[to]
    restored = load_file(tmp_path / "f" / "model.safetensors")
    assert {t.dtype for t in restored.values() if t.is_floating_point()} == {want}
    norms = [r for r in summary.rows if r.name.endswith("norm.weight")]
    assert norms and all(r.cast and not r.restored for r in norms)
    config = json.loads((tmp_path / "f" / "config.json").read_text())
    assert config["dtype"] == to and "torch_dtype" not in config
