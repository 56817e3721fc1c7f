"""A mixture-of-experts checkpoint whose per-expert Linears do not make the stacked weights its
config.json describes: calibrate refuses it in one line naming the tensor, before a block runs,
exit 1, stdout empty, nothing written. An expert's Linear larger than config.json's sizes (the
checkpoint holds more values than the model, so the count check passes) is caught as the block
stacks it; an expert missing, by the count check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tests.conftest import Invoke  # noqa: E402
from tests.moe_models import EXPERTS, build_moe  # noqa: E402

W1 = "model.layers.0.block_sparse_moe.experts.2.w1.weight"


def _edited(directory: Path, change: str) -> Path:
    model = build_moe(directory, "mixtral")
    tensors = load_file(model / "model.safetensors")
    if change == "wider":
        tensors[W1] = torch.cat([tensors[W1], tensors[W1][:32]])
    else:
        for name in [n for n in tensors if f".experts.{EXPERTS - 1}." in n]:
            del tensors[name]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    (directory.parent / "t.txt").write_text("alpha beta gamma delta " * 40)
    return model


@pytest.mark.parametrize("change", ["wider", "missing"])
def test_experts_that_do_not_make_the_configs_weights_are_refused(
    tmp_path: Path, invoke: Invoke, change: str
) -> None:
    model = _edited(tmp_path / "m", change)
    out = tmp_path / "x.imatrix.gguf"
    text = str(tmp_path / "t.txt")
    code, stdout, err = invoke(
        "calibrate", str(model), "-o", str(out), "--text", text, "--tokens", "64", "--ctx", "32"
    )
    assert code == 1 and stdout == "" and err.count("\n") == 1, err
    if change == "wider":
        assert f"tensor {W1!r}" in err and "make a matrix of [224, 64]" in err, err
        assert "config.json's sizes make [192, 64]" in err, err
    else:
        assert "config.json" in err and "describes a model of" in err, err
        # the example is what is missing, not the router the checkpoint stores under its name
        assert "(model.layers.0.mlp.experts.gate_up_proj [4, 192, 64] is in no" in err, err
    assert not out.exists()
