"""A model directory transformers saved after loading a GGUF file: its config.json keeps the
`quantization_config` transformers sets on such a model (`{"quant_method": "gguf", ...}`, what
transformers 5.23's `model.config.save_pretrained` writes) over float weights. qtool treats it
as the float model it is when every tensor is a plain float, drops the stale key from what it
writes and says so; any other quantization_config, or the marker over non-float tensors, is
refused, naming the key and how to remove it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool.engine.model.config import float_source
from qtool.errors import InputError
from qtool.formats import stale_config
from tests.conftest import Invoke

CT = ("--format", "compressed-tensors")
# what transformers 5.23 writes for a model loaded with from_pretrained(d, gguf_file=...)
GGUF_MARKER = {"dequantize": False, "gguf_file": "tiny-llama.gguf", "quant_method": "gguf"}


def with_qconfig(model: Path, qconfig: dict[str, object]) -> Path:
    doc = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**doc, "quantization_config": qconfig}))
    return model


@pytest.fixture
def marked(samples: Path) -> Path:
    return with_qconfig(samples / "tiny-llama", GGUF_MARKER)


def test_gguf_marker_over_float_weights_exports_as_the_float_model(
    invoke: Invoke, samples: Path, marked: Path, tmp_path: Path
) -> None:
    plain = tmp_path / "plain-src"
    plain.mkdir()
    for f in marked.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    doc = json.loads((plain / "config.json").read_text())
    del doc["quantization_config"]
    (plain / "config.json").write_text(json.dumps(doc))
    code, _, err = invoke("quantize", str(marked), *CT, "-o", str(tmp_path / "a"))
    assert code == 0, err
    assert 'dropped quantization_config {"quant_method": "gguf"}' in err
    assert invoke("quantize", str(plain), *CT, "-o", str(tmp_path / "b"))[0] == 0
    q = json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and "gguf_file" not in q
    same = ("config.json", "model.safetensors")
    for name in same:  # byte for byte the export of the same directory without the key
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_gguf_marker_over_a_non_float_tensor_is_refused(
    invoke: Invoke, marked: Path, tmp_path: Path
) -> None:
    tensors = load_file(marked / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(
        tensors["model.layers.0.mlp.up_proj.weight"].shape, dtype=torch.int8
    )
    save_file(tensors, marked / "model.safetensors", metadata={"format": "pt"})
    code, out, err = invoke("quantize", str(marked), *CT, "-o", str(tmp_path / "o"))
    assert code == 1 and out == "" and not (tmp_path / "o").exists()
    assert "model.layers.0.mlp.up_proj.weight is I8, not float" in err
    assert 'delete the "quantization_config" key' in err


@pytest.mark.parametrize("method", ["bitsandbytes", "awq", None])
def test_any_other_quantization_config_is_refused_naming_the_key(
    invoke: Invoke, samples: Path, tmp_path: Path, method: str | None
) -> None:
    qconfig: dict[str, object] = {"quant_method": method} if method else {"bits": 4}
    model = with_qconfig(samples / "tiny-llama", qconfig)
    code, out, err = invoke("quantize", str(model), *CT, "-o", str(tmp_path / "o"))
    assert code == 1 and out == ""
    assert "already quantized: config.json has a quantization_config" in err
    assert 'delete the "quantization_config" key from config.json' in err
    assert (f'(quant_method "{method}")' in err) is (method is not None)
    with pytest.raises(InputError, match='delete the "quantization_config" key'):
        float_source(model)


def test_eval_takes_a_gguf_marked_directory_as_float(marked: Path) -> None:
    found, config = float_source(marked)
    assert "quantization_config" not in config  # transformers gets the config without it
    assert not found.quantized


def test_the_marker_is_only_stale_over_plain_floats() -> None:
    stale_config.check_float_weights([("a", "F32"), ("b", "BF16"), ("c", "F16")], None)
    for dtype in ("I8", "U8", "F8_E4M3", "I32"):
        with pytest.raises(InputError, match=f"b is {dtype}, not float"):
            stale_config.check_float_weights([("a", "F32"), ("b", dtype)], None)
    assert stale_config.is_gguf_marker({"quantization_config": GGUF_MARKER})
    assert not stale_config.is_gguf_marker({"quantization_config": {"quant_method": "awq"}})
    assert not stale_config.is_gguf_marker({"quantization_config": "gguf"})


@pytest.mark.slow
def test_eval_of_a_gguf_marked_directory_equals_the_float_model(tmp_path: Path) -> None:
    """eval takes the marked directory as FLOAT (it refused it before) and hands transformers
    the config without the key: it evaluates exactly as the float model against itself."""
    pytest.importorskip("transformers")
    from qtool import api
    from tests.eval_models import build

    build(tmp_path / "llama", "llama")
    marked = with_qconfig(tmp_path / "llama", GGUF_MARKER)
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    options = api.EvalOptions(text=tmp_path / "text.txt", tokens=100, ctx=48)
    s = api.evaluate(marked, marked, options)
    assert s.causal is not None and s.causal.kl.max == 0.0 and s.causal.top1 == 1.0
