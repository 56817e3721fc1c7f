"""quantize HF_DIR --format gguf checks every tokenizer file as gguf-py's SpecialVocab and the
token list read it, before either does: a tokenizer_config.json that is a FIFO or /dev/zero was
skipped (the chat template lost without a word), a bos_token of {'content': 5} or an
add_bos_token of 'yes' dropped silently, non-integer vocab ids, a post_processor (or a part
of one) of another type than gguf-py walks, config.json's negative bos_token_id or a
text_config that is not an object, malformed added_tokens, a chat template list of
non-strings, invalid JSON in tokenizer_config.json (read only by gguf-py for qwen2) or
chat_template.json were internal errors, and a tokenizer.json linked to /dev/zero
said "no tokenizer.json". Each is one line naming the file and key, exit 1, nothing written."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Invoke
from tests.formats.gguf.hf_models import write_model

pytest.importorskip("transformers")


def _edit(name: str, change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(src: Path) -> None:
        doc = json.loads((src / name).read_text())
        change(doc)
        (src / name).write_text(json.dumps(doc))

    return apply


def _replace(name: str, by: Callable[[Path], None]) -> Callable[[Path], None]:
    def apply(src: Path) -> None:
        (src / name).unlink(missing_ok=True)
        by(src / name)

    return apply


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _write(text: bytes) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_bytes(text)

    return write


def _first_vocab_id(value: object) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        vocab = doc["model"]["vocab"]
        vocab[next(iter(vocab))] = value

    return change


CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "config fifo": (_replace("tokenizer_config.json", _fifo), ("tokenizer_config.json", "FIFO")),
    "config dev zero": (
        _replace("tokenizer_config.json", _dev_zero),
        ("tokenizer_config.json", "symlink to /dev/zero"),
    ),
    "tokenizer dev zero": (
        _replace("tokenizer.json", _dev_zero),
        ("tokenizer.json", "symlink to /dev/zero"),
    ),
    "tokenizer fifo": (_replace("tokenizer.json", _fifo), ("tokenizer.json", "FIFO")),
    "bos content int": (
        _edit("tokenizer_config.json", lambda d: d.update(bos_token={"content": 5})),
        ("tokenizer_config.json", "bos_token"),
    ),
    "add_bos yes": (
        _edit("tokenizer_config.json", lambda d: d.update(add_bos_token="yes")),
        ("tokenizer_config.json", "add_bos_token"),
    ),
    "template list": (
        _edit("tokenizer_config.json", lambda d: d.update(chat_template=[1, 2])),
        ("tokenizer_config.json", "chat_template"),
    ),
    "config invalid json": (
        _replace("tokenizer_config.json", _write(b"{not json")),
        ("tokenizer_config.json",),
    ),
    "chat_template.json invalid": (
        _replace("chat_template.json", _write(b"[1,")),
        ("chat_template.json",),
    ),
    "chat_template.json list": (
        _replace("chat_template.json", _write(b'{"chat_template": [3]}')),
        ("chat_template.json", "chat_template"),
    ),
    "jinja not utf-8": (
        _replace("chat_template.jinja", _write(b"\xff\xfe{{ x }}")),
        ("chat_template.jinja",),
    ),
    "vocab id string": (
        _edit("tokenizer.json", _first_vocab_id("7")),
        ("tokenizer.json", "model.vocab"),
    ),
    "vocab id negative": (
        _edit("tokenizer.json", _first_vocab_id(-1)),
        ("tokenizer.json", "model.vocab"),
    ),
    "added tokens dict": (
        _edit("tokenizer.json", lambda d: d.update(added_tokens={"a": 1})),
        ("tokenizer.json", "added_tokens"),
    ),
    "post_processor list": (
        _edit("tokenizer.json", lambda d: d.update(post_processor=[1])),
        ("tokenizer.json", "post_processor"),
    ),
    "template of ints": (
        _edit(
            "tokenizer.json",
            lambda d: d.update(post_processor={"type": "TemplateProcessing", "single": [1, 2]}),
        ),
        ("tokenizer.json", "post_processor.single"),
    ),
    "processors int": (
        _edit("tokenizer.json", lambda d: d.update(post_processor={"processors": 5})),
        ("tokenizer.json", "post_processor.processors"),
    ),
    "roberta cls null": (
        _edit(
            "tokenizer.json",
            lambda d: d.update(post_processor={"type": "RobertaProcessing", "cls": None}),
        ),
        ("tokenizer.json", "post_processor.cls"),
    ),
    "negative bos id": (
        _edit("config.json", lambda d: d.update(bos_token_id=-1)),
        ("config.json", "bos_token_id"),
    ),
    "text_config int": (
        _edit("config.json", lambda d: (d.pop("bos_token_id"), d.update(text_config=5))),
        ("config.json", "text_config"),
    ),
    "added token no id": (
        _edit("tokenizer.json", lambda d: d["added_tokens"].append({"content": "x"})),
        ("tokenizer.json", "added_tokens["),
    ),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_tokenizer_files_refused_in_one_line(
    tmp_path: Path, invoke: Invoke, arch: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qtool.formats.gguf import hf_vocab

    # the tiny tokenizer's pre-tokenizer taken as gpt-2's (the converter's table lacks it)
    monkeypatch.setattr(hf_vocab, "pre_tokenizer", lambda directory: "gpt-2")
    src = write_model(tmp_path / "m", arch)
    damage, words = CASES[case]
    damage(src)
    out = tmp_path / "o.gguf"
    code, stdout, err = invoke(
        "quantize", str(src), "--format", "gguf", "--dtype", "Q8_0", "-o", str(out)
    )
    assert code == 1, err
    assert stdout == "" and "internal error" not in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no output, no scratch
