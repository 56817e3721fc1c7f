"""A SentencePiece model directory's side files (tokenizer.json beside tokenizer.model,
config.json, tokenizer_config.json) are checked as gguf-py's SpecialVocab and the token list
read them, as the byte-level BPE path checks them: a post_processor of another shape than
gguf-py walks, a negative bos_token_id, a text_config that is not an object were internal
errors ("AttributeError: 'list' object has no attribute 'get'"), now one line naming the file
and key; an added_tokens_decoder id of 5,000 digits (past any vocabulary) was int()'s
"Exceeds the limit (4300 digits)" and is now left out as every id past vocab_size is."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Invoke
from tests.formats.gguf.sp_models import build

pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")


def _edit(name: str, change: Callable[[dict[str, Any]], object]) -> Callable[[Path], None]:
    def apply(src: Path) -> None:
        doc = json.loads((src / name).read_text())
        change(doc)
        (src / name).write_text(json.dumps(doc))

    return apply


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "post_processor list": (
        _edit("tokenizer.json", lambda d: d.update(post_processor=[1])), "post_processor"),
    "template of ints": (
        _edit("tokenizer.json", lambda d: d.update(
            post_processor={"type": "TemplateProcessing", "single": [1, 2]})),
        "post_processor.single"),
    "processors int": (
        _edit("tokenizer.json", lambda d: d.update(post_processor={"processors": 5})),
        "post_processor.processors"),
    "pair item list": (
        _edit("tokenizer.json", lambda d: d["post_processor"].update(pair=[{"Sequence": [1]}])),
        "post_processor.pair"),
    "negative bos id": (_edit("config.json", lambda d: d.update(bos_token_id=-1)), "bos_token_id"),
    "text_config int": (
        _edit("config.json", lambda d: (d.pop("bos_token_id"), d.update(text_config=5))),
        "text_config"),
    "text_config negative": (
        _edit("config.json", lambda d: (d.pop("bos_token_id"),
                                        d.update(text_config={"bos_token_id": -3}))),
        "text_config.bos_token_id"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_side_file_refused_in_one_line(tmp_path: Path, invoke: Invoke, case: str) -> None:
    src = build(tmp_path, "llama2")
    damage, key = CASES[case]
    damage(src)
    out = tmp_path / "o.gguf"
    code, stdout, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "F16",
                               "-o", str(out))  # fmt: skip
    assert code == 1, err
    assert stdout == "" and "internal error" not in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    name = "config.json" if "id" in key or "text_config" in key else "tokenizer.json"
    assert f"{src / name}:" in err and key in err, err
    assert not out.exists()


def test_an_added_token_id_of_thousands_of_digits_is_left_out(
    tmp_path: Path, invoke: Invoke
) -> None:
    outs = []
    for n, key in enumerate(["9" * 5000, "9" * 19]):
        src = build(tmp_path / str(n), "llama2")
        config = json.loads((src / "tokenizer_config.json").read_text())
        config["added_tokens_decoder"][key] = {"content": "<far>", "special": True}
        (src / "tokenizer_config.json").write_text(json.dumps(config))
        outs.append(tmp_path / f"{n}.gguf")
        code, _, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "F16",
                              "-o", str(outs[-1]))  # fmt: skip
        assert code == 0, err
    tokens = [gguf.GGUFReader(o).fields["tokenizer.ggml.tokens"] for o in outs]
    texts = [[bytes(t.parts[i]) for i in t.data] for t in tokens]
    assert b"<far>" not in texts[0] and texts[0] == texts[1]


def test_a_number_of_thousands_of_digits_is_invalid_json(tmp_path: Path, invoke: Invoke) -> None:
    """added_tokens.json {"<x>": 5,000 digits}: refused naming the file, without telling the
    user to call sys.set_int_max_str_digits() (Python's own message was passed on)."""
    src = build(tmp_path, "llama2")
    (src / "added_tokens.json").write_text('{"<x>": ' + "9" * 5000 + "}")
    out = tmp_path / "o.gguf"
    code, _, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "F16",
                          "-o", str(out))  # fmt: skip
    assert code == 1 and "added_tokens.json" in err and "4,300 digits" in err, err
    assert "sys." not in err and len(err.strip().splitlines()) == 1, err
