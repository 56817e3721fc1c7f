"""A shipped recipe runs clean on the kind of model it is written for: no warning line
(issue 33: examples/llm.toml warned "rule 2 'lm_head.*' matches no tensor" on SmolLM2, the
model it is measured on, whose output head is its tied embedding). The sample's tiny Llama
has tied embeddings as SmolLM2 does; an untied copy of it has an lm_head of its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import SAMPLES, Invoke

RECIPE = Path(__file__).parents[2] / "examples" / "llm.toml"


def _untied(tmp_path: Path) -> Path:
    """The tiny Llama with an output head of its own (tie_word_embeddings false)."""
    dest = tmp_path / "untied"
    shutil.copytree(SAMPLES / "tiny-lm", dest)
    tensors = load_file(dest / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    return dest


@pytest.mark.parametrize("fmt", ["qtool", "compressed-tensors"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_llm_recipe_warns_nothing_and_keeps_the_head_float(
    invoke: Invoke, tmp_path: Path, fmt: str, tied: bool
) -> None:
    src = SAMPLES / "tiny-lm" if tied else _untied(tmp_path)
    code, out, err = invoke("quantize", str(src), "--format", fmt, "--recipe", str(RECIPE),
                            "-o", str(tmp_path / "out"), "--dry-run", "--json")  # fmt: skip
    assert code == 0, err
    found = json.loads(out)
    assert "warning" not in err and not found["warnings"], (err, found["warnings"])
    rows = {r["name"]: r for r in found["tensors"]}
    heads = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    for name in heads:
        assert not rows[name]["quantized"], name
        assert "output head" in rows[name]["decided_by"]["reason"], rows[name]
