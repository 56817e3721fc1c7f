"""quantize HF_DIR --format gguf checks every safetensors shard's header with qtool's parser
before the conversion reads a value: a truncated shard and a tensor present in two shards were
"internal error" (safetensors' own exception) or a silent pick of one copy. Each is refused in
one line naming the file (and tensor), exit 1, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Invoke
from tests.formats.gguf.hf_models import write_model

pytest.importorskip("transformers")


def _refused(invoke: Invoke, src: Path, tmp_path: Path) -> str:
    out = tmp_path / "o.gguf"
    code, stdout, err = invoke(
        "quantize", str(src), "--format", "gguf", "--dtype", "Q8_0", "-o", str(out)
    )
    assert code == 1, err
    assert stdout == "" and "internal error" not in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no output, no scratch
    return err


@pytest.mark.parametrize("cut", [1, 4096, 400_000])
def test_truncated_shard_is_refused_naming_it(tmp_path: Path, invoke: Invoke, cut: int) -> None:
    src = write_model(tmp_path / "m", "llama")
    weights = src / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - cut)
    err = _refused(invoke, src, tmp_path)
    assert "model.safetensors" in err and "safetensors" in err


def test_tensor_in_two_shards_is_refused_naming_both(tmp_path: Path, invoke: Invoke) -> None:
    from safetensors.torch import load_file, save_file

    src = write_model(tmp_path / "m", "llama")
    state = load_file(src / "model.safetensors")
    save_file({"model.norm.weight": state["model.norm.weight"]}, src / "stray.safetensors")
    err = _refused(invoke, src, tmp_path)
    assert "model.norm.weight" in err and "model.safetensors" in err and "stray" in err
