"""A damaged or hostile tokenizer.model (formats/gguf/sp_model.py reads it without the
sentencepiece package): every wire-format fault (a number or field running past the end, a
number of more than 10 bytes, an undefined wire type, field number 0), what sentencepiece
refuses on load (an empty or duplicate piece, no or two unknown pieces, a type outside the enum,
a byte piece not named <0xHH>) and what a GGUF cannot carry (a score that is not finite, text
that is not UTF-8) is one InputError naming the file, with no allocation sized by a number the
file declares (lengths are checked against the bytes left; pieces and the file are counted
against MAX_PIECES and MAX_MODEL_BYTES). Through quantize HF_DIR --format gguf: exit 1, one
line, nothing written; the added-token files the conversion reads with it likewise."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from qtool.errors import InputError
from qtool.formats.gguf import sp_model
from tests.conftest import Invoke
from tests.formats.gguf.sp_models import varint as _varint

pytest.importorskip("sentencepiece")


def _field(number: int, wire: int, payload: bytes) -> bytes:
    key = _varint(number << 3 | wire)
    if wire == 2:
        return key + _varint(len(payload)) + payload
    return key + payload


def _piece(text: bytes, score: float = 0.0, kind: int = 1) -> bytes:
    body = _field(1, 2, text) + _field(2, 5, struct.pack("<f", score)) + _field(3, 0, _varint(kind))
    return _field(1, 2, body)


BASE = _piece(b"<unk>", kind=2) + _piece(b"<s>", kind=3) + _piece(b"\xe2\x96\x81a", -1.0)
"""A valid model: <unk>, <s>, ▁a."""

CASES: dict[str, tuple[bytes, str]] = {
    "truncated": (BASE[:-2], "a field of 13 bytes where 11 are left"),
    "endless-number": (b"\x0a" + b"\xff" * 20, "longer than 10 bytes"),
    "length-past-end": (BASE + b"\x0a" + _varint(1_000_000) + b"xx", "1,000,000 bytes where 2"),
    "huge-length": (b"\x0a" + _varint(2**63), "bytes where 0 are left"),
    "group-wire-type": (BASE + _varint(1 << 3 | 3), "wire type 3"),
    "field-zero": (b"\x00" + BASE, "field number 0"),
    "trainer-spec-not-message": (BASE + _field(2, 0, _varint(5)), "field 2 is not a message"),
    "trainer-spec-damaged": (BASE + _field(2, 2, b"\x08"), "runs past the end"),
    "score-not-float": (
        BASE + _field(1, 2, _field(1, 2, b"b") + _field(2, 0, _varint(1))),
        "score is not a float",
    ),
    "not-utf8": (BASE + _piece(b"\xff\xfe"), "not UTF-8 text"),
    "empty-piece": (BASE + _piece(b""), "is empty"),
    "duplicate": (BASE + _piece(b"<s>"), "is piece 1 again"),
    "nan-score": (BASE + _piece(b"b", float("nan")), "has score nan"),
    "inf-score": (BASE + _piece(b"b", float("-inf")), "has score -inf"),
    "type-outside-enum": (BASE + _piece(b"b", kind=9), "has type 9"),
    "type-negative": (BASE + _piece(b"b", kind=2**64 - 1), "has type -1,"),
    "empty": (b"", "has no pieces"),
    "byte-piece-misnamed": (BASE + _piece(b"<0xZZ>", kind=6), "byte piece not named"),
    "no-unknown": (BASE[len(_piece(b"<unk>", kind=2)) :], "has no unknown piece"),
    "two-unknown": (BASE + _piece(b"<unk2>", kind=2), "has 2 unknown pieces (ids 0, 3)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_model_is_refused_naming_it(tmp_path: Path, case: str) -> None:
    data, match = CASES[case]
    path = tmp_path / "tokenizer.model"
    path.write_bytes(data)
    with pytest.raises(InputError) as err:
        sp_model.read_pieces(path)
    message = str(err.value)
    assert match in message and str(path) in message
    assert "\n" not in message


def test_base_is_valid(tmp_path: Path) -> None:
    """The cases damage a model the reader takes (so each refusal is the damage's)."""
    path = tmp_path / "tokenizer.model"
    path.write_bytes(BASE)
    assert [p.text for p in sp_model.read_pieces(path)] == ["<unk>", "<s>", "\u2581a"]


def test_piece_count_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces are counted against MAX_PIECES as they are read: one past it is refused."""
    monkeypatch.setattr(sp_model, "MAX_PIECES", 8)
    path = tmp_path / "tokenizer.model"
    path.write_bytes(BASE + b"".join(_piece(f"p{i}".encode()) for i in range(5)))
    assert len(sp_model.read_pieces(path)) == 8
    path.write_bytes(BASE + b"".join(_piece(f"p{i}".encode()) for i in range(6)))
    with pytest.raises(InputError, match="more than 8 pieces"):
        sp_model.read_pieces(path)


def test_file_size_is_bounded(tmp_path: Path) -> None:
    """A file past MAX_MODEL_BYTES is refused before it is read whole (a sparse file)."""
    path = tmp_path / "tokenizer.model"
    with path.open("wb") as f:
        f.write(BASE)
        f.truncate(sp_model.MAX_MODEL_BYTES + 1)
    with pytest.raises(InputError, match="tokenizer.model"):
        sp_model.read_pieces(path)


def _model_dir(tmp_path: Path) -> Path:
    from tests.formats.gguf.sp_models import write_sp_model

    return write_sp_model(tmp_path / "m", "llama2")


def _json_file(name: str, doc: object) -> Callable[[Path], None]:
    def apply(src: Path) -> None:
        (src / name).write_text(json.dumps(doc))

    return apply


def _decoder(doc: object) -> Callable[[Path], None]:
    def apply(src: Path) -> None:
        config = json.loads((src / "tokenizer_config.json").read_text())
        config["added_tokens_decoder"] = doc
        (src / "tokenizer_config.json").write_text(json.dumps(config))

    return apply


def _model(data: bytes) -> Callable[[Path], None]:
    def apply(src: Path) -> None:
        (src / "tokenizer.model").write_bytes(data)

    return apply


def _fifo(src: Path) -> None:
    (src / "tokenizer.model").unlink()
    os.mkfifo(src / "tokenizer.model")


DIRECTORY_CASES: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "truncated-model": (_model(CASES["truncated"][0]), "tokenizer.model", "where 11 are left"),
    "nan-score": (_model(CASES["nan-score"][0]), "tokenizer.model", "has score nan"),
    "fifo": (_fifo, "tokenizer.model", "not a regular file (a FIFO)"),
    "more-pieces-than-rows": (
        _model(BASE + b"".join(_piece(f"p{i}".encode()) for i in range(400))),
        "tokenizer.model",
        "the embedding has no row for piece",
    ),
    "added-id-not-int": (
        _json_file("added_tokens.json", {"<x>": "5"}),
        "added_tokens.json",
        "expected a token id",
    ),  # fmt: skip
    "added-id-negative": (
        _json_file("added_tokens.json", {"<x>": -1}),
        "added_tokens.json",
        "expected a token id",
    ),  # fmt: skip
    "added-not-object": (_json_file("added_tokens.json", ["<x>"]), "added_tokens.json", ""),
    "decoder-key": (
        _decoder({"+5": {"content": "<x>"}}),
        "tokenizer_config.json",
        "added_tokens_decoder has key",
    ),  # fmt: skip
    "decoder-item": (
        _decoder({"5": {"content": 5}}),
        "tokenizer_config.json",
        "expected {'content': a string",
    ),  # fmt: skip
    "decoder-not-object": (_decoder([1]), "tokenizer_config.json", "expected an object"),
}


@pytest.mark.parametrize("case", sorted(DIRECTORY_CASES))
def test_damaged_tokenizer_files_refused_by_quantize(
    tmp_path: Path, invoke: Invoke, case: str
) -> None:
    """Each: exit 1, one line naming the file and the fault, no traceback, nothing written
    (the converter raised KeyError, ValueError or IndexError, wrote a negative id at the end of
    the list, or hung on the FIFO)."""
    change, name, match = DIRECTORY_CASES[case]
    src = _model_dir(tmp_path)
    change(src)
    out = tmp_path / "o.gguf"
    code, stdout, stderr = invoke("quantize", str(src), "--format", "gguf", "--dtype", "Q8_0",
                                  "-o", str(out))  # fmt: skip
    assert code == 1, stderr
    assert stdout == ""
    assert name in stderr and match in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert "Traceback" not in stderr
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


BYTES = BASE + _piece(b"<0x00>", kind=6)
FALLBACK = _field(2, 2, _field(35, 0, _varint(1)))
ALL_BYTES = BASE + b"".join(_piece(f"<0x{b:02X}>".encode(), kind=6) for b in range(256))


@pytest.mark.parametrize(
    ("data", "refused"),
    [
        (BYTES, True),  # no trainer spec: a file cut at a piece boundary
        (BYTES + _field(2, 2, _field(4, 0, _varint(4))), True),  # a spec without byte_fallback
        (BYTES + _field(2, 2, _field(35, 0, _varint(0))), True),
        (ALL_BYTES + FALLBACK + _field(2, 2, _field(35, 0, _varint(0))), True),  # the last counts
        (BYTES + FALLBACK, True),  # byte_fallback needs all 256
        (ALL_BYTES + FALLBACK, False),
    ],
    ids=["no-spec", "spec-without", "fallback-0", "last-is-0", "not-256", "fallback-256"],
)
def test_byte_pieces_need_byte_fallback_as_sentencepiece_does(
    tmp_path: Path, data: bytes, refused: bool
) -> None:
    """A model with byte pieces loads only when its trainer spec sets byte_fallback (else
    sentencepiece: "byte piece <0x00> is found although `byte_fallback` is false"), and then
    only with all 256 of them: the reader
    refuses exactly what sentencepiece refuses, so a tokenizer.model cut before its trainer
    spec is not padded into a GGUF llama.cpp tokenizes differently."""
    spm = pytest.importorskip("sentencepiece")
    path = tmp_path / "tokenizer.model"
    path.write_bytes(data)
    try:
        spm.SentencePieceProcessor(model_proto=data)
        loads = True
    except (RuntimeError, OSError):
        loads = False
    assert loads is not refused
    if refused:
        with pytest.raises(InputError, match="byte_fallback"):
            sp_model.read_pieces(path)
    else:
        assert [p.kind for p in sp_model.read_pieces(path)][-1] == sp_model.BYTE
