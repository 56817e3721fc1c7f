"""quantize HF_DIR --format gguf reads each config.json key it uses with its type and range and
checks it against the checkpoint's tensors (formats/gguf/hf_config.py). Values of the wrong
type reached gguf-py's writer or torch as "internal error" (heads True or 1e6, rms_norm_eps
'x', a yarn scaling without its original context); values contradicting the tensors (a block
count, head_dim 0, heads not dividing the hidden size) were written into a GGUF with exit 0.
Each is refused in one line naming config.json and the key, exit 1, nothing written."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import Invoke
from tests.formats.gguf.hf_models import write_model

pytest.importorskip("transformers")

CASES: list[tuple[str, dict[str, Any]]] = [
    # contradicting the checkpoint (exit 0 before)
    ("num_hidden_layers", {"num_hidden_layers": 1}),
    ("num_hidden_layers", {"num_hidden_layers": 3}),
    ("head_dim", {"head_dim": 0}),
    ("head_dim", {"head_dim": 8}),
    ("intermediate_size", {"intermediate_size": [96]}),
    ("intermediate_size", {"intermediate_size": 95}),
    ("num_attention_heads", {"num_attention_heads": 3}),
    ("hidden_size", {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}),
    # the wrong type or range ("internal error" before)
    ("num_attention_heads", {"num_attention_heads": True}),
    ("num_attention_heads", {"num_attention_heads": 10**6}),
    ("num_key_value_heads", {"num_key_value_heads": 3}),
    ("num_key_value_heads", {"num_key_value_heads": -2}),
    ("num_key_value_heads", {"num_key_value_heads": "2"}),
    ("max_position_embeddings", {"max_position_embeddings": 2**70}),
    ("max_position_embeddings", {"max_position_embeddings": -1}),
    ("max_position_embeddings", {"max_position_embeddings": "128"}),
    ("head_dim", {"head_dim": "x"}),
    ("rms_norm_eps", {"rms_norm_eps": "x"}),
    ("original_max_position_embeddings", {"rope_parameters": {"rope_type": "yarn", "factor": 4}}),
    ("rope factor", {"rope_parameters": {"rope_type": "linear", "factor": "x"}}),
    ("rope_theta", {"rope_parameters": {"rope_theta": "big"}}),
    ("rope_theta", {"rope_parameters": None, "rope_theta": "big"}),
    ("vocab_size", {"vocab_size": True}),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(("key", "change"), CASES, ids=[str(c) for _, c in CASES])
def test_config_values_refused_in_one_line(
    tmp_path: Path, invoke: Invoke, arch: str, key: str, change: dict[str, Any]
) -> None:
    src = write_model(tmp_path / "m", arch)
    config = json.loads((src / "config.json").read_text())
    config.update(change)
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "o.gguf"
    code, stdout, err = invoke(
        "quantize", str(src), "--format", "gguf", "--dtype", "Q8_0", "-o", str(out)
    )
    assert code == 1, err
    assert stdout == ""
    assert "config.json" in err and key in err and "expected" in err, err
    assert "internal error" not in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no output, no scratch


def _reshape(name: str, shape: tuple[int, ...]) -> Callable[[dict[str, torch.Tensor]], None]:
    """One tensor given another shape: its values reshaped, or cut to the shape's size."""

    def edit(state: dict[str, torch.Tensor]) -> None:
        t = state[name].reshape(-1)[: math.prod(shape)]
        state[name] = t.reshape(shape).contiguous()

    return edit


# (arch, key the message names, tensor, its new shape): any tensor of the family, not only the
# q/k/v/gate/up rows checked before (exit 0: a GGUF llama.cpp and transformers refuse to load)
SHAPES: list[tuple[str, str, str, tuple[int, ...]]] = [
    ("llama", "hidden_size", "model.layers.0.mlp.down_proj.weight", (96, 64)),  # transposed
    ("llama", "hidden_size", "model.layers.1.self_attn.o_proj.weight", (32, 128)),
    ("llama", "vocab_size", "lm_head.weight", (640, 32)),
    ("llama", "hidden_size", "model.layers.1.post_attention_layernorm.weight", (32,)),
    ("llama", "[64] (hidden_size)", "model.norm.weight", (8, 8)),  # a rank the config denies
    ("llama", "[64] (hidden_size)", "model.layers.0.input_layernorm.weight", (2, 32)),
    ("llama", "[64, 64]", "model.layers.0.self_attn.q_proj.weight", (4, 16, 64)),
    ("qwen2", "[32]", "model.layers.1.self_attn.k_proj.bias", (2, 16)),
]


@pytest.mark.parametrize("dtype", ["Q8_0", "F16"])
@pytest.mark.parametrize(("arch", "key", "name", "shape"), SHAPES, ids=[s[2] for s in SHAPES])
def test_tensor_shapes_config_denies_refused_in_one_line(
    tmp_path: Path, invoke: Invoke, dtype: str, arch: str, key: str, name: str,
    shape: tuple[int, ...],
) -> None:  # fmt: skip
    from safetensors.torch import load_file, save_file

    src = write_model(tmp_path / "m", arch)
    weights = src / "model.safetensors"
    state = load_file(weights)
    _reshape(name, shape)(state)
    save_file(state, weights, metadata={"format": "pt"})
    out = tmp_path / "o.gguf"
    code, stdout, err = invoke(
        "quantize", str(src), "--format", "gguf", "--dtype", dtype, "-o", str(out)
    )
    assert code == 1, err
    assert stdout == ""
    assert "config.json" in err and name in err and key in err, err
    assert "internal error" not in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_every_tensor_of_each_family_passes_the_shape_check(tmp_path: Path) -> None:
    """The check knows each tensor the family saves (biases, norms, a tied head or not): a
    valid model is checked tensor by tensor, none of them skipped as unknown."""
    from qtool.formats.gguf.hf_config import _expected_shapes, check_shapes
    from qtool.io.stformat import read_header

    for arch, tied in (("llama", False), ("qwen2", True), ("mistral", False)):
        src = write_model(tmp_path / f"{arch}{tied}", arch, tied=tied)
        config = json.loads((src / "config.json").read_text())
        shapes = [(t.name, t.shape) for t in read_header(src / "model.safetensors").tensors]
        check_shapes(config, shapes, src / "config.json")
        known = _expected_shapes(config)
        unknown = [n for n, _ in shapes if n.split(".", 3)[-1] not in known and n not in known]
        assert unknown == [], unknown
