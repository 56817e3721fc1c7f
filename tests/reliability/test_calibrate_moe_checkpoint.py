"""A mixture-of-experts checkpoint whose per-expert Linears or router do not make the weights its
config.json describes, or a config.json whose expert counts the checkpoint does not back:
calibrate refuses it in one line naming config.json and the tensor or key, before a block runs,
exit 1, stdout empty, nothing written. Every stored expert Linear and router is checked against
the shape config.json implies (wider, narrower, transposed, 1-D, 3-D, empty: each was an
internal error or a mis-stacked matrix); an expert missing is caught by the count check;
num_experts_per_tok must route each token to 1 to the experts (0 ran and weighed nothing, 8 of
4 or -1 crashed the router)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tests.conftest import Invoke  # noqa: E402
from tests.moe_models import EXPERTS, build_moe  # noqa: E402

W1 = "model.layers.0.block_sparse_moe.experts.2.w1.weight"


_RESHAPED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "narrow": lambda w: w[:, :50],
    "transposed": lambda w: w.t(),
    "3d": lambda w: w.unsqueeze(0),
    "1d": lambda w: w.reshape(-1)[:64],
    "empty": lambda w: w[:0],
}


def _edit_config(model: Path, **keys: object) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | keys))


def _edited(directory: Path, change: str) -> Path:
    model = build_moe(directory, "mixtral")
    tensors = load_file(model / "model.safetensors")
    if change == "wider":
        tensors[W1] = torch.cat([tensors[W1], tensors[W1][:32]])
    elif change in _RESHAPED:
        tensors[W1] = _RESHAPED[change](tensors[W1]).contiguous()
    elif change == "five_experts":  # a fifth expert in every block, the router still of 4
        for name in [n for n in list(tensors) if ".experts.0." in n]:
            tensors[name.replace(".experts.0.", f".experts.{EXPERTS}.")] = tensors[name].clone()
        _edit_config(model, num_local_experts=EXPERTS + 1)
    elif change.startswith("routed_"):
        _edit_config(model, num_experts_per_tok=int(change.removeprefix("routed_")))
    elif change == "one_layer":
        _edit_config(model, num_hidden_layers=1)
    elif change == "int32":
        tensors[W1] = torch.zeros_like(tensors[W1], dtype=torch.int32)
    else:
        for name in [n for n in tensors if f".experts.{EXPERTS - 1}." in n]:
            del tensors[name]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    (directory.parent / "t.txt").write_text("alpha beta gamma delta " * 40)
    return model


@pytest.mark.parametrize(
    "change",
    [
        "wider",
        "missing",
        *_RESHAPED,
        "five_experts",
        "routed_0",
        "routed_8",
        "routed_-1",
        "one_layer",
        "int32",
    ],
)
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
    assert "config.json" in err or change == "int32", err
    if change == "wider" or change in _RESHAPED:
        held = (
            list(_RESHAPED[change](torch.empty(96, 64)).shape) if change in _RESHAPED else [128, 64]
        )
        assert f"tensor {W1!r}" in err and "config.json makes it [96, 64]" in err, err
        assert f"model.safetensors holds {held}" in err, err
    elif change == "five_experts":
        assert "tensor 'model.layers.0.block_sparse_moe.gate.weight'" in err, err
        assert "makes it [5, 64], but model.safetensors holds [4, 64]" in err, err
    elif change == "int32":  # a float parameter's values stored as integers: never cast
        assert f"model.safetensors: tensor {W1!r}: holds this weight as I32" in err, err
    elif change == "one_layer":  # the message names no other command than the one run
        assert "no place for this tensor" in err and "eval" not in err, err
    elif change.startswith("routed_"):
        routed = change.removeprefix("routed_")
        assert f"num_experts_per_tok is {routed}" in err and "1 to 4 experts" in err, err
    else:
        assert "config.json" in err and "describes a model of" in err, err
        # the example is what is missing, not the router the checkpoint stores under its name
        assert "(model.layers.0.mlp.experts.gate_up_proj [4, 192, 64] is in no" in err, err
    assert not out.exists()


class _Tensors:
    """A checkpoint's tensors in memory, read as calibrate's block loader reads them."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.names = list(tensors)

    def values(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def release(self, name: str) -> None:
        pass


@pytest.mark.parametrize("change", ["transposed", "3d", "1d"])
def test_the_block_loader_checks_each_expert_linear_before_stacking(
    tmp_path: Path, change: str
) -> None:
    """The block loader's own check, for a reader the size check did not see: an expert Linear
    of another rank or width is InputError naming it, not torch.cat's RuntimeError."""
    import transformers

    from qtool.engine.calibrate.blocks import load_module
    from qtool.errors import InputError

    model = build_moe(tmp_path / "m", "mixtral", layers=1)
    tensors = load_file(model / "model.safetensors")
    tensors[W1] = _RESHAPED[change](tensors[W1]).contiguous()
    config = transformers.AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        block = transformers.MixtralForCausalLM(config).model.layers[0]
    reader: Any = _Tensors(tensors)
    with pytest.raises(InputError) as raised:
        load_module(block, "model.layers.0.", reader, torch.device("cpu"), model)
    assert repr(W1) in str(raised.value) and "config.json's sizes make [rows, 64]" in str(
        raised.value
    )
