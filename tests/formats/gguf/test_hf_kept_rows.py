"""quantize HF_DIR --format gguf: a tensor kept unquantized but written in another float type
than the checkpoint's says why in its row. The format decides on the converted copy, where a
norm is F32 already, so a BF16 checkpoint's norm read 'BF16→F32  kept: 1-D (bias/norm)': kept,
yet widened; an F32 checkpoint's excluded matrix is written F16 (the converter's --outtype
auto) under 'kept: excluded'. A tensor written in its own type gets no such words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qtool.formats.gguf import hf_vocab
from tests.conftest import run_qtool
from tests.formats.gguf.hf_models import write_model

pytest.importorskip("transformers")

NORM = "blk.0.attn_norm.weight"
EXCLUDED = "blk.0.ffn_up.weight"


class _Table(dict[str, str]):
    """PRE_TOKENIZERS answering "gpt-2" for the tiny tokenizer's hash (as test_hf_export)."""

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(key, "gpt-2")


@pytest.fixture(autouse=True)
def known_pre_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_vocab, "PRE_TOKENIZERS", _Table(hf_vocab.PRE_TOKENIZERS))


def _rows(tmp_path: Path, dtype: torch.dtype) -> dict[str, dict[str, str]]:
    from safetensors.torch import load_file, save_file

    src = write_model(tmp_path / "m", "llama")
    state = {k: v.to(dtype) for k, v in load_file(src / "model.safetensors").items()}
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    code, out, err = run_qtool(
        "quantize", str(src), "--format", "gguf", "--dtype", "Q8_0", "--exclude", EXCLUDED,
        "-o", str(tmp_path / "o.gguf"), "--json",
    )  # fmt: skip
    assert code == 0, err
    return {r["name"]: r for r in json.loads(out)["tensors"]}


def test_a_bf16_norm_says_it_was_widened(tmp_path: Path) -> None:
    rows = _rows(tmp_path, torch.bfloat16)
    norm = rows[NORM]
    assert (norm["dtype"], norm["out_dtype"]) == ("BF16", "F32")
    assert norm["detail"].startswith("kept: 1-D (bias/norm); BF16 widened to F32")
    assert "convert_hf_to_gguf.py" in norm["detail"]
    kept = rows[EXCLUDED]  # a matrix kept in the copy's BF16: its own type, nothing added
    assert (kept["dtype"], kept["out_dtype"]) == ("BF16", "BF16")
    assert "convert_hf_to_gguf" not in kept["detail"]


def test_an_f32_matrix_kept_says_it_is_written_f16(tmp_path: Path) -> None:
    rows = _rows(tmp_path, torch.float32)
    kept = rows[EXCLUDED]
    assert (kept["dtype"], kept["out_dtype"]) == ("F32", "F16")
    assert "F32 written F16" in kept["detail"]
    assert "--outtype auto" in kept["detail"]
    norm = rows[NORM]  # F32 in, F32 out: the plain reason
    assert (norm["dtype"], norm["out_dtype"]) == ("F32", "F32")
    assert norm["detail"] == "kept: 1-D (bias/norm)"
