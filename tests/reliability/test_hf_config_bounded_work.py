"""quantize HF_DIR --format gguf reads config.json's vocab_size and num_hidden_layers before
any weight: a vocab_size of 10^12 made the token list loop 10^12 times (and hold as many
strings; 4 * 10^9 here, since over 2^32 - 1 is now refused as a type), a num_hidden_layers
of 10^9 built gguf's name map for 10^9 blocks. Both are checked against what the checkpoint
holds (the embedding's rows; llama.cpp's 512-block limit) before any work in proportion
to them: refused in one line, exit 1, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.formats.gguf.hf_models import VOCAB_SIZE, write_model

pytest.importorskip("transformers")

UNBOUNDED = 300  # seconds: only the unbounded loop takes this long (the refusal takes ~5 s)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("vocab_size", 4 * 10**9, f"but model.embed_tokens.weight has {VOCAB_SIZE} rows"),
        ("num_hidden_layers", 10**9, "over llama.cpp's limit of 512 blocks"),
    ],
)
def test_config_numbers_are_checked_before_work(
    tmp_path: Path, key: str, value: int, message: str
) -> None:
    src = write_model(tmp_path / "m", "llama")
    config = json.loads((src / "config.json").read_text())
    config[key] = value
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "o.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "qtool", "quantize", str(src), "--format", "gguf",
         "--dtype", "Q8_0", "-o", str(out)],
        capture_output=True, text=True, timeout=UNBOUNDED,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert message in done.stderr and key in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "name", ["tokenizer.json", "chat_template.jinja", "additional_chat_templates/tool.jinja"]
)
def test_tokenizer_files_over_the_limit_are_refused_unread(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenizer file over MAX_TOKENIZER_BYTES (a sparse file here, so nothing is stored) is
    refused by its size before anything reads it: gguf-py's SpecialVocab read the chat
    templates whole (and, without a chat_template in tokenizer_config.json, wrote a 64 MB
    chat_template.jinja of NULs into the GGUF); tokenizer.json was read whole twice."""
    from qtool.errors import InputError
    from qtool.formats.gguf import hf_vocab
    from qtool.formats.gguf.hf_export import export_float
    from qtool.io.atomic import OutputSet

    src = write_model(tmp_path / "m", "llama")
    # the tiny tokenizer's pre-tokenizer taken as gpt-2's (the converter's table lacks it)
    monkeypatch.setattr(hf_vocab, "pre_tokenizer", lambda directory: "gpt-2")
    config = json.loads((src / "tokenizer_config.json").read_text())
    del config["chat_template"]  # so the file's template is the one taken
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    (src / name).parent.mkdir(exist_ok=True)
    with open(src / name, "r+b" if (src / name).exists() else "wb") as f:
        f.truncate(hf_vocab.MAX_TOKENIZER_BYTES + 1)
    out = tmp_path / "o.gguf"
    over = f"is {hf_vocab.MAX_TOKENIZER_BYTES + 1:,} bytes, over"
    with pytest.raises(InputError, match=over), OutputSet() as outputs:
        export_float(src, out, outputs, "F32")
        outputs.commit()
    assert not out.exists()
