"""quantize HF_DIR --format gguf reads each config.json key it uses with its type and range and
checks it against the checkpoint's tensors (formats/gguf/hf_config.py). Values of the wrong
type reached gguf-py's writer or torch as "internal error" (heads True or 1e6, rms_norm_eps
'x', a yarn scaling without its original context); values contradicting the tensors (a block
count, head_dim 0, heads not dividing the hidden size) were written into a GGUF with exit 0.
Each is refused in one line naming config.json and the key, exit 1, nothing written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

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
