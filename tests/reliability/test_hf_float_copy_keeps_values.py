"""quantize HF_DIR --format gguf copies an F32 checkpoint to F16 first (the converter's
--outtype auto); a finite weight beyond F16's range (1e6) became Inf in the copy and the run
blamed the checkpoint for a value it does not hold. The copy stays F32 when any value would
overflow; the quantized output holds the value."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import Invoke
from tests.formats.gguf.hf_models import write_model

pytest.importorskip("transformers")

NAME = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize("value", [1e6, -7e4])
def test_weight_beyond_f16_range_is_quantized_not_refused(
    tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch, value: float
) -> None:
    from safetensors.torch import load_file, save_file

    from qtool.formats.gguf import hf_vocab
    from qtool.formats.gguf.reader import GGUFFloatReader

    # the tiny tokenizer's pre-tokenizer taken as gpt-2's (the converter's table lacks it)
    monkeypatch.setattr(hf_vocab, "pre_tokenizer", lambda directory: "gpt-2")
    src = write_model(tmp_path / "m", "llama")
    state = load_file(src / "model.safetensors")
    assert state[NAME].dtype is torch.float32
    state[NAME][3, 5] = value
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "o.gguf"
    code, _, err = invoke(
        "quantize", str(src), "--format", "gguf", "--dtype", "Q8_0", "-o", str(out)
    )
    assert code == 0, err
    with GGUFFloatReader(out) as reader:
        got = reader.values("blk.0.ffn_down.weight")
    assert torch.isfinite(got).all()
    assert got.flatten()[got.abs().argmax()].item() == pytest.approx(value, rel=0.01)
