"""A weight holding NaN or infinite values makes every activation after it, and so every
statistic, NaN: calibrate refuses it as it loads the block, in one line naming the tensor,
exit 1, stdout empty, nothing written, for every weight the pass loads (a dense Linear, a
norm, an expert's Linear, a router). It was an internal error, ValueError '1 sums are
negative, NaN or infinite' from the statistics, naming no tensor (or none at all where the
expert was never routed to)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tests.conftest import Invoke  # noqa: E402
from tests.moe_models import build_moe  # noqa: E402

TINY_LM = Path(__file__).resolve().parents[2] / "sample_weights" / "tiny-lm"
DENSE = ["model.layers.0.mlp.gate_proj.weight", "model.layers.1.post_attention_layernorm.weight"]
MOE = ["model.layers.0.block_sparse_moe.experts.2.w1.weight",
       "model.layers.1.block_sparse_moe.gate.weight"]  # fmt: skip


@pytest.mark.parametrize(("kind", "name"), [*(("dense", n) for n in DENSE),
                                            *(("mixtral", n) for n in MOE)])  # fmt: skip
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_nonfinite_weight_is_refused_naming_it(
    tmp_path: Path, invoke: Invoke, kind: str, name: str, value: float
) -> None:
    if kind == "dense":
        model = tmp_path / "m"
        shutil.copytree(TINY_LM, model)
    else:
        model = build_moe(tmp_path / "m", kind)
    tensors = load_file(model / "model.safetensors")
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[1] = value
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    text = tmp_path / "t.txt"
    text.write_text("alpha beta gamma delta " * 40)
    out = tmp_path / "x.imatrix.gguf"
    code, stdout, err = invoke(
        "calibrate", str(model), "--text", str(text), "--tokens", "64", "--ctx", "32",
        "-o", str(out),
    )  # fmt: skip
    assert code == 1 and stdout == "" and err.count("\n") == 1, err
    assert f"tensor {name!r}" in err and "has 1 NaN/Inf values" in err, err
    assert not out.exists()


def test_activations_that_overflow_the_sums_are_refused_naming_the_weight(
    tmp_path: Path, invoke: Invoke
) -> None:
    """Finite weights of huge magnitude (a norm of 1e30): the squared inputs of the Linears
    after it sum beyond float32; the error names the first such weight, no warning printed."""
    model = tmp_path / "m"
    shutil.copytree(TINY_LM, model)
    tensors = load_file(model / "model.safetensors")
    norm = "model.layers.0.input_layernorm.weight"
    tensors[norm] = torch.full_like(tensors[norm], 1e30)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    text = tmp_path / "t.txt"
    text.write_text("alpha beta gamma delta " * 40)
    code, stdout, err = invoke(
        "calibrate", str(model), "--text", str(text), "--tokens", "64", "--ctx", "32",
        "-o", str(tmp_path / "x.imatrix.gguf"),
    )  # fmt: skip
    assert code == 1 and stdout == "" and err.count("\n") == 1, err
    assert "self_attn.q_proj.weight'" in err and "do not sum to finite" in err, err
