"""`qtool calibrate MODEL -o OUT`: OUT is never one of MODEL's files (its config, its weights,
a weight file linked from elsewhere) nor anything inside MODEL's directory, even with --force;
refused before the model is read, MODEL untouched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import Invoke

TINY_LM = Path(__file__).resolve().parents[2] / "sample_weights" / "tiny-lm"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """tiny-lm with its weights a link to a file outside its directory."""
    d = tmp_path / "lm"
    shutil.copytree(TINY_LM, d)
    (d / "model.safetensors").rename(tmp_path / "weights.safetensors")
    (d / "model.safetensors").symlink_to(tmp_path / "weights.safetensors")
    return d


@pytest.mark.parametrize("name", ["lm/config.json", "lm/model.safetensors", "lm/new.gguf",
                                  "weights.safetensors"])  # fmt: skip
def test_the_output_is_never_a_file_of_the_model_nor_inside_it(
    invoke: Invoke, tmp_path: Path, model: Path, name: str
) -> None:
    before = {p.name: p.read_bytes() for p in [*model.iterdir(), tmp_path / "weights.safetensors"]}
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    code, out, err = invoke("calibrate", str(model), "--text", str(text), "-o",
                            str(tmp_path / name), "--force", "--json")  # fmt: skip
    assert (code, out) == (1, ""), err
    error = json.loads(err)["error"]
    assert error["code"] == "output"
    assert "input" in error["message"]
    after = {p.name: p.read_bytes() for p in [*model.iterdir(), tmp_path / "weights.safetensors"]}
    assert after == before
    assert not (model / "new.gguf").exists()
