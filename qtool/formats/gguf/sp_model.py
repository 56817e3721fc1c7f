"""A SentencePiece tokenizer.model read without the sentencepiece package: the pieces of its
ModelProto (sentencepiece_model.proto), each its text, score and type, as
SentencePieceProcessor's IdToPiece / GetScore / IsUnknown ... give them.

    pieces = read_pieces(path)   # [Piece(text, score, kind), ...] in id order

The file is untrusted: every varint, length and count is checked against the bytes left, the
file against MAX_MODEL_BYTES and the pieces against MAX_PIECES before anything grows with them;
what sentencepiece itself refuses on load (an empty or duplicate piece, no or two unknown
pieces, a type outside the enum, byte pieces when the trainer spec's byte_fallback is unset,
as in a file cut before its trainer spec, or other than 256 when it is set) and what a GGUF
cannot carry (a score that is not finite, text that is not UTF-8) is an InputError naming
the file. Fields other than the pieces and byte_fallback (the trainer and normalizer specs)
are skipped after their wire format is checked.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from qtool.errors import InputError
from qtool.io.safeopen import read_bounded

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
"""SentencePiece.Type (and the converter's SentencePieceTokenTypes, gguf.TokenType)."""

MAX_MODEL_BYTES = 64_000_000
"""As a tokenizer.json (hf_vocab.MAX_TOKENIZER_BYTES): real tokenizer.model files are 0.5 MB
(Llama 2, Mistral: 32,000 pieces) to 4.5 MB (Gemma: 256,000 pieces); the file is read whole."""
MAX_PIECES = 1_048_576
"""Four times the largest real vocabulary (Gemma's 262,144 pieces): reading that many takes
about 300 MB (docs/reliability.md has the figures)."""

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


@dataclass(frozen=True, slots=True)
class Piece:
    text: str
    score: float
    kind: int  # NORMAL ... BYTE


def read_pieces(path: Path, most: int = MAX_PIECES, why: str = "") -> list[Piece]:
    """The pieces of the tokenizer.model at `path` in id order (InputError if it is not one);
    refused as soon as a piece past `most` is found (`why` says why, after "has more than N
    pieces"), before it is read."""
    data = read_bounded(path, MAX_MODEL_BYTES, "SentencePiece model")
    most = min(most, MAX_PIECES)
    try:
        pieces, byte_fallback = _model(memoryview(data), most)
    except _TooMany:
        raise InputError(path, f"has more than {most:,} pieces{why or '; is it intact?'}"
                         ) from None  # fmt: skip
    except _Bad as err:
        raise InputError(path, f"not a SentencePiece model: {err}; is it intact?") from None
    _check(pieces, path, byte_fallback)
    return pieces


class _Bad(Exception):
    """A wire-format fault, with the byte offset it was found at."""


class _TooMany(Exception):
    """More pieces than the caller takes."""


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise _Bad(f"a number runs past the end (byte {pos:,})")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 64:  # protobuf varints are at most 10 bytes
            raise _Bad(f"a number longer than 10 bytes (byte {pos:,})")


def _fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of one message, one at a time (a million pieces' views
    held at once cost 200 MB): an int for a number, the bytes of a length-delimited field (a
    view, not a copy)."""
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0 or number > 536_870_911:
            raise _Bad(f"field number {number:,} (byte {start:,})")
        value: int | memoryview
        if wire == _VARINT:
            value, pos = _varint(buf, pos)
        elif wire in (_I64, _I32):
            size = 8 if wire == _I64 else 4
            if pos + size > len(buf):
                raise _Bad(f"a {size}-byte value runs past the end (byte {start:,})")
            value = int.from_bytes(buf[pos : pos + size], "little")
            pos += size
        elif wire == _LEN:
            length, pos = _varint(buf, pos)
            if length > len(buf) - pos:
                raise _Bad(f"a field of {length:,} bytes where {len(buf) - pos:,} are left "
                           f"(byte {start:,})")  # fmt: skip
            value = buf[pos : pos + length]
            pos += length
        else:  # 3, 4: groups (not in this schema); 6, 7: undefined
            raise _Bad(f"wire type {wire} (byte {start:,})")
        yield number, wire, value


_BYTE_FALLBACK = 35
"""TrainerSpec.byte_fallback's field number: sentencepiece refuses a BYTE piece without it."""


def _model(buf: memoryview, most: int) -> tuple[list[Piece], bool]:
    """The pieces and the trainer spec's byte_fallback (last value wins, as protobuf merges)."""
    pieces: list[Piece] = []
    byte_fallback = False
    for number, wire, value in _fields(buf):
        if number != 1:
            if number in (2, 3, 5) and wire != _LEN:  # trainer, normalizer, denormalizer specs
                raise _Bad(f"field {number} is not a message")
            if isinstance(value, memoryview) and number in (2, 3, 5):
                for field, kind, got in _fields(value):  # a damaged spec is refused
                    if number == 2 and field == _BYTE_FALLBACK and kind == _VARINT:
                        byte_fallback = bool(got)
            continue
        if not isinstance(value, memoryview):
            raise _Bad("a piece is not a message")
        if len(pieces) >= most:
            raise _TooMany
        pieces.append(_piece(value, len(pieces)))
    return pieces, byte_fallback


def _piece(buf: memoryview, index: int) -> Piece:
    """One SentencePiece message: piece (1), score (2, float), type (3); a field given twice
    takes its last value, as protobuf does."""
    raw: memoryview | None = None
    score, kind = 0.0, NORMAL
    for number, wire, value in _fields(buf):
        if number == 1:
            if not isinstance(value, memoryview):
                raise _Bad(f"piece {index:,}: its text is not a string")
            raw = value
        elif number == 2:
            if wire != _I32 or not isinstance(value, int):
                raise _Bad(f"piece {index:,}: its score is not a float")
            score = struct.unpack("<f", value.to_bytes(4, "little"))[0]
        elif number == 3:
            if wire != _VARINT or not isinstance(value, int):
                raise _Bad(f"piece {index:,}: its type is not an enum")
            kind = value
    if raw is None or len(raw) == 0:
        raise _Bad(f"piece {index:,} is empty")
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as err:
        raise _Bad(f"piece {index:,} is not UTF-8 text (its byte {err.start:,})") from None
    return Piece(text, score, kind)


def _check(pieces: list[Piece], path: Path, byte_fallback: bool) -> None:
    """What SentencePieceProcessor refuses on load, and scores a GGUF cannot carry."""
    if not pieces:
        raise InputError(path, "has no pieces (an empty or cut SentencePiece model); is it "
                         "intact?")  # fmt: skip
    seen: dict[str, int] = {}
    unknown = []
    for i, piece in enumerate(pieces):
        shown = _short(piece.text)
        if not NORMAL <= piece.kind <= BYTE:
            kind = piece.kind - (1 << 64) if piece.kind >= 1 << 63 else piece.kind  # an int32
            raise InputError(path, f"piece {i:,} ({shown}) has type {kind}, expected 1 "
                             "to 6 (NORMAL ... BYTE); is it intact?")  # fmt: skip
        if not math.isfinite(piece.score):
            raise InputError(path, f"piece {i:,} ({shown}) has score {piece.score}, expected a "
                             "finite number; is it intact?")  # fmt: skip
        if piece.text in seen:
            raise InputError(path, f"piece {i:,} ({shown}) is piece {seen[piece.text]:,} again; "
                             "is it intact?")  # fmt: skip
        if piece.kind == BYTE and not _BYTE_PIECE.fullmatch(piece.text):
            raise InputError(path, f"piece {i:,} ({shown}) is a byte piece not named <0xHH>; "
                             "is it intact?")  # fmt: skip
        if piece.kind == BYTE and not byte_fallback:  # a file cut before its trainer spec
            raise InputError(path, f"piece {i:,} ({shown}) is a byte piece, but the trainer "
                             "spec does not set byte_fallback (sentencepiece refuses that); "
                             "is it intact?")  # fmt: skip
        seen[piece.text] = i
        if piece.kind == UNKNOWN:
            unknown.append(i)
    byte_pieces = sum(piece.kind == BYTE for piece in pieces)
    if byte_fallback and byte_pieces != 256:
        raise InputError(path, f"has {byte_pieces:,} byte pieces, but its trainer spec sets "
                         "byte_fallback, which needs all 256 (sentencepiece refuses it); is it "
                         "intact?")  # fmt: skip
    if not unknown:
        raise InputError(path, "has no unknown piece (<unk>), which sentencepiece requires; "
                         "is it intact?")  # fmt: skip
    if len(unknown) > 1:
        ids = f"ids {unknown[0]:,}, {unknown[1]:,}"
        raise InputError(path, f"has {len(unknown):,} unknown pieces ({ids}), where "
                         "sentencepiece takes one; is it intact?")  # fmt: skip


def _short(text: str) -> str:
    shown = repr(text)
    return shown if len(shown) <= 40 else shown[:37] + "..."
