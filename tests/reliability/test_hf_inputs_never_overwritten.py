"""quantize HF_DIR --format gguf protects every file the conversion reads, as a single-file
input is protected: only the directory itself was, so `-o` onto the file a link in HF_DIR
points to (a weight file, the tokenizer, the config kept elsewhere) replaced the user's file
with the quantized GGUF, even with --force. Refused before anything is written, exit 1."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.conftest import Invoke
from tests.formats.gguf.hf_models import write_model

pytest.importorskip("transformers")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "name", ["model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"]
)
def test_output_onto_a_linked_input_is_refused(tmp_path: Path, invoke: Invoke, name: str) -> None:
    src = write_model(tmp_path / "m", "llama")
    kept = tmp_path / "elsewhere" / f"{name}.gguf"  # a name quantize's -o takes
    kept.parent.mkdir()
    (src / name).rename(kept)
    (src / name).symlink_to(kept)
    before = _sha(kept)
    code, out, err = invoke(
        "quantize", str(src), "--format", "gguf", "--dtype", "Q8_0", "-o", str(kept), "--force"
    )
    assert code == 1, err
    assert out == ""
    assert "would overwrite the input" in err and "Traceback" not in err
    assert _sha(kept) == before
    assert sorted(p.name for p in kept.parent.iterdir()) == [kept.name]  # no scratch left


def test_output_onto_a_file_in_the_directory_is_refused(tmp_path: Path, invoke: Invoke) -> None:
    src = write_model(tmp_path / "m", "llama")
    (src / "model.safetensors").rename(src / "model.gguf")
    (src / "model.safetensors").symlink_to("model.gguf")
    before = _sha(src / "model.gguf")
    code, _, err = invoke(
        "quantize", str(src), "--format", "gguf", "--dtype", "Q8_0",
        "-o", str(src / "model.gguf"), "--force",
    )  # fmt: skip
    assert code == 1 and "would overwrite the input" in err, err
    assert _sha(src / "model.gguf") == before
