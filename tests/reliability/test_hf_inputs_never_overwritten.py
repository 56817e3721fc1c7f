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
    assert code == 1 and "inside the input directory" in err, err  # any new file there is
    assert _sha(src / "model.gguf") == before


@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
@pytest.mark.parametrize("where", [".", "new.gguf", "sub"])
def test_no_new_file_inside_the_model_directory(
    tmp_path: Path, invoke: Invoke, dtype: str, where: str
) -> None:
    """`-o HF_DIR` (the default name inside it), a file inside it, or a directory inside it:
    a new file in the model's directory changes the model, and docs/reliability.md says -o
    equal to or inside the input is refused; it wrote HF_DIR/m.F16.gguf."""
    src = write_model(tmp_path / "m", "llama")
    (src / "sub").mkdir()
    before = sorted(p.name for p in src.rglob("*"))
    code, out, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", dtype,
                            "-o", str(src / where))  # fmt: skip
    assert code == 1, err
    assert out == "" and "inside the input directory" in err and "Traceback" not in err, err
    assert sorted(p.name for p in src.rglob("*")) == before
