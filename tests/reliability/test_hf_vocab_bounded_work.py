"""The vocabulary of quantize HF_DIR --format gguf is read with work bounded by what the model
can hold, not by what a file declares: a tokenizer.model is read only up to config.json's
vocab_size pieces (a 10 MB file of 1,048,576 pieces for a vocabulary of 400 read every piece,
10.8 s and 468 MB, before it was refused), and tokenizer_config.json and added_tokens.json are
refused past MAX_ADDED_TOKENS_BYTES before they are parsed (a 63 MB added_tokens.json of 3.4
million ids past the vocabulary was accepted after 45 s and 1.3 GB)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Invoke
from tests.formats.gguf.sp_models import varint as _varint
from tests.formats.gguf.sp_models import write_sp_model

pytest.importorskip("sentencepiece")


def _piece(text: bytes) -> bytes:
    body = b"\x0a" + _varint(len(text)) + text + b"\x15" + struct.pack("<f", 0.0) + b"\x18\x01"
    return b"\x0a" + _varint(len(body)) + body


def _quantize(invoke: Invoke, src: Path, out: Path) -> tuple[int, str]:
    code, stdout, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "F16",
                               "-o", str(out))  # fmt: skip
    assert stdout == "" or code == 0
    return code, err


def test_pieces_past_the_vocabulary_are_never_read(
    tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qtool.formats.gguf import sp_model

    src = write_sp_model(tmp_path / "m", "llama2")
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    model = (src / "tokenizer.model").read_bytes()
    extra = 20 * vocab
    (src / "tokenizer.model").write_bytes(
        model + b"".join(_piece(f"extra{i}".encode()) for i in range(extra))
    )
    read = []
    parse = sp_model._piece
    monkeypatch.setattr(sp_model, "_piece", lambda buf, i: read.append(i) or parse(buf, i))
    out = tmp_path / "o.gguf"
    code, err = _quantize(invoke, src, out)
    assert code == 1 and "tokenizer.model" in err and f"vocab_size is {vocab:,}" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert len(read) <= vocab  # before: every one of the vocab + extra pieces
    assert not out.exists()


@pytest.mark.parametrize("name", ["added_tokens.json", "tokenizer_config.json"])
def test_added_token_files_are_bounded_before_parsing(
    tmp_path: Path, invoke: Invoke, name: str
) -> None:
    from qtool.formats.gguf.hf_vocab import MAX_ADDED_TOKENS_BYTES

    src = write_sp_model(tmp_path / "m", "llama2")
    doc = json.loads((src / name).read_text()) if (src / name).exists() else {}
    text = json.dumps(doc)
    (src / name).write_text(text[:-1] + " " * (MAX_ADDED_TOKENS_BYTES - len(text) + 1) + "}")
    out = tmp_path / "o.gguf"
    code, err = _quantize(invoke, src, out)
    assert code == 1 and name in err and f"{MAX_ADDED_TOKENS_BYTES:,} bytes" in err, err
    assert not out.exists()


def test_a_sparse_file_over_the_limit_is_not_read(
    tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The private copy (engine/hf_gguf.py) refuses a file whose size is over the limit before
    reading it: a sparse tokenizer.json was read for 64 MB of zeros first."""
    from qtool.engine import hf_gguf

    src = write_sp_model(tmp_path / "m", "llama2", tokenizer_json=True)
    with (src / "tokenizer.json").open("r+b") as f:
        f.truncate(hf_gguf.MAX_TOKENIZER_BYTES + 1)
    read: list[str] = []
    real = hf_gguf.read_limited

    def counted(f: Any, limit: int, what: str, path: Path) -> bytes:
        read.append(path.name)
        return real(f, limit, what, path)

    monkeypatch.setattr(hf_gguf, "read_limited", counted)
    code, err = _quantize(invoke, src, tmp_path / "o.gguf")
    assert code == 1 and "tokenizer.json" in err and "64,000,000" in err, err
    assert "tokenizer.json" not in read
