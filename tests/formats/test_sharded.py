from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from qtool import api
from qtool.cli import app
from qtool.engine.inspect import inspect_path
from qtool.engine.plan import QuantizeOptions
from qtool.errors import InputError, OutputError
from qtool.spec import QSpec, Scheme


def make_sharded(directory: Path, shards: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """A small HF-style sharded checkpoint with a config file; returns all its tensors."""
    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    everything: dict[str, torch.Tensor] = {}
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        sd = {
            f"layers.{i}.proj.weight": torch.randn(48, 32, generator=gen).to(torch.bfloat16),
            f"layers.{i}.norm.weight": torch.ones(48, dtype=torch.bfloat16),
            f"layers.{i}.ids": torch.arange(5),
        }
        save_file(sd, directory / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(sd, name)
        everything |= sd
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text('{"hidden_size": 48}')
    (directory / "tokenizer.json").write_text("{}")
    return everything


@pytest.mark.parametrize("scheme", list(Scheme))
@pytest.mark.parametrize("via", ["directory", "index"])
def test_sharded_round_trip_keeps_sharding_and_companions(
    tmp_path: Path, scheme: Scheme, via: str
) -> None:
    original = make_sharded(tmp_path / "model")
    src = (
        tmp_path / "model"
        if via == "directory"
        else tmp_path / "model/model.safetensors.index.json"
    )
    summary = api.quantize(src, None, QuantizeOptions(QSpec(scheme)), device="cpu")
    out = tmp_path / "model.int8"
    assert summary.outputs == [str(out)]
    names = sorted(p.name for p in out.iterdir() if p.name != ".qtool-export.json")
    assert names == sorted(
        [f"model-0000{i}-of-00003{suffix}" for i in (1, 2, 3)
         for suffix in (".safetensors", ".qparams.safetensors")]
        + ["model.safetensors.index.json", "config.json", "tokenizer.json"]
    )  # fmt: skip
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert (
        index["weight_map"]
        == json.loads((tmp_path / "model/model.safetensors.index.json").read_text())["weight_map"]
    )
    shard_bytes = sum(p.stat().st_size for p in out.glob("model-*-of-00003.safetensors"))
    assert index["metadata"]["total_size"] < shard_bytes
    marked = json.loads((out / "config.json").read_text())  # no float loader takes the codes
    assert marked["hidden_size"] == 48 and marked["quantization_config"]["quant_method"] == "qtool"
    assert len(summary.quantized) == 3

    api.dequantize(out, None)
    restored_dir = tmp_path / "model.int8.dequantized"
    assert json.loads((restored_dir / "config.json").read_text()) == {"hidden_size": 48}
    restored: dict[str, torch.Tensor] = {}
    for shard in restored_dir.glob("model-*.safetensors"):
        restored |= load_file(shard)
    assert set(restored) == set(original)
    for name, x in original.items():
        y = restored[name]
        assert (y.dtype, y.shape) == (x.dtype, x.shape)
        if "proj" not in name:
            assert torch.equal(x, y)
        else:
            assert (x.float() - y.float()).abs().max() < 0.05


def test_inspect_sharded(tmp_path: Path) -> None:
    make_sharded(tmp_path / "m")
    summary = inspect_path(tmp_path / "m")
    assert summary.kind == "sharded" and summary.shards == 3 and len(summary.rows) == 9
    api.quantize(tmp_path / "m", tmp_path / "q", QuantizeOptions(), device="cpu")
    quantized = inspect_path(tmp_path / "q")
    assert quantized.kind == "sharded quantized"
    assert sum(1 for r in quantized.rows if r.qinfo) == 3


def _index(directory: Path) -> Path:
    return directory / "model.safetensors.index.json"


def _edit_index(directory: Path, edit: object) -> None:
    doc = json.loads(_index(directory).read_text())
    edit(doc)  # type: ignore[operator]
    _index(directory).write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["weight_map"].update({"x": "../evil.safetensors"}), "escapes"),
        (lambda d: d["weight_map"].update({"x": "/abs/evil.safetensors"}), "escapes"),
        (lambda d: d["weight_map"].update({"x": "C:evil.safetensors"}), "escapes"),
        (lambda d: d["weight_map"].update({"x": "pytorch_model.bin"}), "never names pickles"),
        (lambda d: d["weight_map"].update({"x": "missing.safetensors"}), "missing"),
        (lambda d: d["weight_map"].update({"ghost": "model-00001-of-00003.safetensors"}),
         "missing from the shard"),
        (lambda d: d["weight_map"].pop("layers.0.ids"), "not listed"),
        (lambda d: d.pop("weight_map"), "weight_map"),
    ],
)  # fmt: skip
def test_bad_indexes_fail_before_anything_is_written(
    tmp_path: Path, edit: object, message: str
) -> None:
    make_sharded(tmp_path / "m")
    _edit_index(tmp_path / "m", edit)
    with pytest.raises(InputError, match=message):
        api.quantize(tmp_path / "m", tmp_path / "out", QuantizeOptions(), device="cpu")
    assert not (tmp_path / "out").exists()


def test_corrupt_last_shard_fails_before_the_first_is_written(tmp_path: Path) -> None:
    make_sharded(tmp_path / "m")
    last = tmp_path / "m/model-00003-of-00003.safetensors"
    last.write_bytes(last.read_bytes()[:-3])
    with pytest.raises(InputError, match="truncated"):
        api.quantize(tmp_path / "m", tmp_path / "out", QuantizeOptions(), device="cpu")
    assert not (tmp_path / "out").exists()


def test_output_directory_rules(tmp_path: Path) -> None:
    make_sharded(tmp_path / "m")
    with pytest.raises(OutputError, match="input directory"):
        api.quantize(tmp_path / "m", tmp_path / "m", QuantizeOptions(), device="cpu")
    api.quantize(tmp_path / "m", tmp_path / "o", QuantizeOptions(), device="cpu")
    with pytest.raises(OutputError, match="only when asked"):
        api.quantize(tmp_path / "m", tmp_path / "o", QuantizeOptions(), device="cpu")
    api.quantize(tmp_path / "m", tmp_path / "o", QuantizeOptions(), device="cpu", force=True)


# ---- identity by device and inode, symlinks out of the directory, name collisions -----------


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_output_dir_that_is_the_input_through_a_symlinked_parent_is_refused(
    tmp_path: Path,
) -> None:
    make_sharded(tmp_path / "m")
    (tmp_path / "alias").symlink_to(tmp_path)
    before = _snapshot(tmp_path / "m")
    with pytest.raises(OutputError, match="input directory"):
        api.quantize(
            tmp_path / "m", tmp_path / "alias" / "m", QuantizeOptions(), device="cpu", force=True
        )
    assert _snapshot(tmp_path / "m") == before


@pytest.mark.slow
def test_output_dir_that_is_the_input_through_a_bind_mount_is_refused(tmp_path: Path) -> None:
    """A bind mount has its own path string (resolve() cannot see through it) but the same
    device and inode; run in a private mount namespace so nothing leaks out of the test."""
    make_sharded(tmp_path / "m")
    (tmp_path / "view").mkdir()
    before = _snapshot(tmp_path / "m")
    script = (
        f"mount --bind {tmp_path / 'm'} {tmp_path / 'view'} && "
        f"{sys.executable} -m qtool quantize {tmp_path / 'm'} -o {tmp_path / 'view'} --force"
    )
    unshare = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c"]
    probe = subprocess.run([*unshare, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no private mount namespaces here (unshare failed)")
    result = subprocess.run([*unshare, script], capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    assert "is the input directory" in result.stderr
    assert _snapshot(tmp_path / "m") == before


def test_companions_are_regular_files_inside_the_directory(tmp_path: Path) -> None:
    make_sharded(tmp_path / "m")
    secret = tmp_path / "secret.txt"
    secret.write_text("API_KEY=hunter2")
    (tmp_path / "m/tokenizer.json").unlink()
    (tmp_path / "m/tokenizer.json").symlink_to(secret)
    (tmp_path / "m/generation_config.json").symlink_to("/proc/self/environ")
    (tmp_path / "m/vocab.txt").write_text("a b c")
    (tmp_path / "m/merges.txt").symlink_to("vocab.txt")  # stays inside: copied
    os.mkfifo(tmp_path / "m/pipe.json")
    summary = api.quantize(tmp_path / "m", tmp_path / "q", QuantizeOptions(), device="cpu")
    copied = sorted(
        p.name
        for p in (tmp_path / "q").iterdir()
        if not p.name.endswith(("tensors", ".qtool-export.json"))
    )
    assert copied == ["config.json", "merges.txt", "model.safetensors.index.json", "vocab.txt"]
    assert not (tmp_path / "q/merges.txt").is_symlink()
    assert (tmp_path / "q/merges.txt").read_text() == "a b c"
    assert len(summary.notes) == 3
    assert any("tokenizer.json: not copied: a symlink to" in n for n in summary.notes)
    assert any("generation_config.json: not copied" in n for n in summary.notes)
    assert any("pipe.json: not copied: not a regular file" in n for n in summary.notes)
    # the same policy when dequantizing, and each skip is one warning line on stderr
    result = CliRunner().invoke(app, ["dequantize", str(tmp_path / "q"), "--json"])
    assert result.exit_code == 0, result.stderr
    json.loads(result.stdout)
    assert result.stderr == ""  # q/ holds only regular files: nothing skipped
    (tmp_path / "q/tokenizer.json").symlink_to(secret)
    result = CliRunner().invoke(app, ["dequantize", str(tmp_path / "q"), "-o", str(tmp_path / "r")])
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("\n") == 1 and "tokenizer.json: not copied" in result.stderr
    assert not (tmp_path / "r/tokenizer.json").exists()


def test_sidecar_of_a_shard_linked_from_outside_is_refused(tmp_path: Path) -> None:
    make_sharded(tmp_path / "m")
    api.quantize(tmp_path / "m", tmp_path / "q", QuantizeOptions(), device="cpu")
    side = tmp_path / "q/model-00001-of-00003.qparams.safetensors"
    side.rename(tmp_path / "moved.safetensors")
    side.symlink_to(tmp_path / "moved.safetensors")
    with pytest.raises(InputError, match="outside the checkpoint directory"):
        api.dequantize(tmp_path / "q", tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_plot_into_a_sharded_run_is_checked_with_its_outputs(tmp_path: Path) -> None:
    make_sharded(tmp_path / "m")
    (tmp_path / "q").mkdir()
    clash = tmp_path / "q" / "config.json"
    # a plot inside the output directory, which qtool publishes whole, is refused before any write
    with pytest.raises(OutputError, match="lies inside the output directory"):
        api.quantize(tmp_path / "m", tmp_path / "q", QuantizeOptions(), device="cpu", also=[clash])
    assert list((tmp_path / "q").iterdir()) == []


def test_a_sidecar_path_for_a_sharded_checkpoint_is_a_usage_error(tmp_path: Path) -> None:
    from qtool.errors import UsageError

    make_sharded(tmp_path / "m")
    api.quantize(tmp_path / "m", tmp_path / "q", QuantizeOptions(), device="cpu")
    with pytest.raises(UsageError, match="one sidecar per shard"):
        api.dequantize(tmp_path / "q", tmp_path / "r", qparams=tmp_path / "x.safetensors")


def test_an_index_that_names_no_tensor_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(InputError, match="names no tensor"):
        api.quantize(tmp_path / "m", tmp_path / "q", QuantizeOptions(), device="cpu")
