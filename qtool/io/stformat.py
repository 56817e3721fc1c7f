"""The safetensors container: parse and validate a header, build one for a streaming writer.

Pure Python (no torch): `inspect` and `--dry-run` answer from headers alone. The checks match
the reference parser (safetensors' tensor.rs) and are stricter where Python's json module is
laxer than serde_json: duplicate keys, NaN literals, lone surrogates and absurd nesting are
refused. Nothing is allocated from a size the file declares before that size is checked.
"""

from __future__ import annotations

import functools
import json
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import BinaryIO

from qtool.dtypes import DTYPE_BITS
from qtool.io.safeopen import open_regular
from qtool.io.shapes import shape_overflow

MAX_HEADER_BYTES = 100_000_000  # the reference's cap (decimal MB)

# The reference writer sorts by the Dtype enum's declaration order, descending.
_DTYPE_RANK = {name: rank for rank, name in enumerate(DTYPE_BITS)}


class HeaderError(ValueError):
    """The bytes are not a valid safetensors file; the message says what is wrong."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a header: offsets are relative to the start of the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Header:
    """A validated header: tensors in data order, string metadata, where the data starts."""

    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str] | None
    data_start: int  # 8 + header length

    def by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    @property
    def data_bytes(self) -> int:
        return self.tensors[-1].end if self.tensors else 0


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of the safetensors file at `path` (HeaderError if bad)."""
    with open_regular(path) as f:
        return read_header_file(f)


def read_header_file(f: BinaryIO) -> Header:
    """Read and validate the header of an open safetensors file (from its start)."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    prefix = f.read(8)
    header_len = _header_length(prefix, size)
    raw = f.read(header_len)
    if len(raw) != header_len:
        raise HeaderError("file changed while being read")
    return parse_header(raw, size)


_SIGNATURES = (  # what a file that fails to parse as safetensors often is instead
    (b"\x93NUMPY", "a numpy .npy array"),
    (b"GGUF", "a GGUF file (llama.cpp)"),
    (b"\x89PNG", "a PNG image"),
)


def describe_non_checkpoint(path: str | os.PathLike[str]) -> str | None:
    """What a file that is not a valid safetensors file looks like (JSON text, a numpy array,
    a GGUF file), or None when its content says nothing recognisable or its first 8 bytes are
    a plausible header length (then it is a damaged safetensors file, and the parse error says
    more)."""
    with open(path, "rb") as f:
        return describe_head(f.read(64))


def describe_head(head: bytes) -> str | None:
    """describe_non_checkpoint, from a file's first 64 bytes."""
    if len(head) >= 8 and int.from_bytes(head[:8], "little") <= MAX_HEADER_BYTES:
        return None  # a plausible safetensors header length: a damaged safetensors file
    for signature, what in _SIGNATURES:
        if head.startswith(signature):
            return what
    if head.lstrip()[:1] in (b"{", b"["):
        return "JSON text (a config or index file?)"
    if head.lstrip().lower().startswith((b"<!doctype html", b"<html")):
        return "an HTML page (a download that returned a web page?)"
    if head.startswith(b"version https://git-lfs"):
        return "a Git LFS pointer, not the file itself (run git lfs pull)"
    if len(head) >= 8 and _is_text(head):
        return "plain text (a README, a script or notes?)"
    return None


def _is_text(head: bytes) -> bool:
    """Printable UTF-8 (a multi-byte character may be cut at the end of the 64 bytes)."""
    text = head.decode("utf-8", errors="ignore")
    whole = len(text.encode()) >= len(head) - 3
    return whole and all(c.isprintable() or c in "\t\r\n" for c in text)


def not_safetensors_message(path: str | os.PathLike[str], err: HeaderError) -> str:
    """Why a file is refused: what it is instead when that is known, else the parse error."""
    what = describe_non_checkpoint(path)
    if what is None:
        return f"not a valid safetensors file: {err}"
    return f"not a checkpoint: {what}; give a .safetensors file or a torch .pt/.pth/.bin state dict"


def _header_length(prefix: bytes, file_size: int) -> int:
    if len(prefix) < 8:
        raise HeaderError(
            f"not a safetensors file: {file_size} bytes, shorter than the 8-byte header length"
        )
    n: int = int.from_bytes(prefix, "little")
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > file_size:
        raise HeaderError(f"header length {n} runs past the end of the {file_size}-byte file")
    return n


def parse_header(raw: bytes, file_size: int) -> Header:
    """Validate header bytes `raw` (without the 8-byte length) of a file of `file_size` bytes."""
    if len(raw) > MAX_REMEMBERED_HEADER:
        return _parse_header(raw, file_size)
    header = _remembered(raw, file_size)
    return replace(header, metadata=None if header.metadata is None else dict(header.metadata))


# detect, the checkpoint sniffer and the readers each validate the header of the same file:
# its bytes are the key, so a file that changed in between is parsed afresh. A header of 50,000
# tensors takes seconds to parse; 4 headers of at most 16 MiB are kept.
MAX_REMEMBERED_HEADER = 16 * 2**20


@functools.lru_cache(maxsize=4)
def _remembered(raw: bytes, file_size: int) -> Header:
    return _parse_header(raw, file_size)


def _parse_header(raw: bytes, file_size: int) -> Header:
    doc = strict_json(raw)
    if not isinstance(doc, dict):
        raise HeaderError("header is not a JSON object")
    metadata = _parse_metadata(doc.pop("__metadata__", None))
    tensors = sorted(
        (_parse_entry(name, info) for name, info in doc.items()),
        key=lambda t: (t.begin, t.end),
    )
    expected = 0
    for t in tensors:
        if t.begin != expected:
            what = "overlaps another tensor" if t.begin < expected else "leaves a gap before it"
            raise HeaderError(f"tensor {t.name!r}: data_offsets [{t.begin}, {t.end}] {what}")
        expected = t.end
    data_start = 8 + len(raw)
    if data_start + expected != file_size:
        have = file_size - data_start
        if have < expected:
            raise HeaderError(f"truncated: header declares {expected} data bytes, file has {have}")
        raise HeaderError(f"{have - expected} trailing bytes not covered by the header")
    return Header(tuple(tensors), metadata, data_start)


def strict_json(raw: bytes) -> object:
    """json.loads that refuses what serde_json refuses (and duplicate keys): HeaderError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise HeaderError(f"header is not UTF-8 (byte {err.start})") from None
    # A lone surrogate can only come from a \u escape (valid UTF-8 holds none): without one,
    # the keys need no per-key check, which costs seconds on a header of 100,000 tensors.
    hook = _checked_pairs if "\\u" in text else _unique_pairs
    _check_depth(text)
    try:
        return json.loads(text, object_pairs_hook=hook, parse_constant=_no_constants)
    except HeaderError:
        raise
    except RecursionError:
        raise HeaderError("header JSON is nested too deeply") from None
    except ValueError as err:  # JSONDecodeError and the int digit limit
        raise HeaderError(f"header is not valid JSON: {err}") from None


MAX_JSON_DEPTH = 100  # configs nest a few levels; serde_json stops at 128
_STRINGS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_EMPTY_PAIRS = re.compile(r"\[\]|\{\}")


def _check_depth(text: str) -> None:
    """HeaderError when arrays/objects nest deeper than MAX_JSON_DEPTH, found before json.loads
    (whose C parser would otherwise recurse until RecursionError). Brackets inside strings are
    counted at first (cheap); only a document that looks too deep is measured again with its
    strings removed. json.loads' own RecursionError stays a HeaderError as a backstop."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return
    naive = _NOT_BRACKETS.sub("", text)
    if _too_deep(naive) and _too_deep(_NOT_BRACKETS.sub("", _STRINGS.sub("", text))):
        raise HeaderError(f"JSON nested more than {MAX_JSON_DEPTH} levels deep")


def _too_deep(skeleton: str) -> bool:
    """Whether a bracket skeleton nests deeper than MAX_JSON_DEPTH: each round removes the
    innermost pairs, so depth d takes d rounds of one C-speed substitution."""
    for _ in range(MAX_JSON_DEPTH):
        inner = _EMPTY_PAIRS.sub("", skeleton)
        if inner == skeleton:
            break
        skeleton = inner
    else:
        return bool(skeleton)
    return skeleton.count("[") + skeleton.count("{") > MAX_JSON_DEPTH  # unbalanced and deep


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        return _checked_pairs(pairs)  # names the first duplicate
    return out


def _checked_pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        _check_text(key)
        if key in out:
            raise HeaderError(f"duplicate key {key!r} in header")
        out[key] = value
    return out


def _no_constants(name: str) -> object:
    raise HeaderError(f"header JSON contains {name}, which is not JSON")


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise HeaderError(f"header string {s!r} holds a lone surrogate") from None


def _parse_metadata(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise HeaderError("__metadata__ must map strings to strings")
    for v in value.values():
        _check_text(v)
    return dict(value)


def _parse_entry(name: str, info: object) -> TensorEntry:
    if not isinstance(info, dict):
        raise HeaderError(f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise HeaderError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not _is_int_list(shape):
        raise HeaderError(f"tensor {name!r}: shape must be a list of non-negative integers")
    overflow = shape_overflow(shape)  # type: ignore[arg-type]
    if overflow is not None:
        raise HeaderError(f"tensor {name!r}: {overflow}")
    if not _is_int_list(offsets) or len(offsets) != 2:  # type: ignore[arg-type]
        raise HeaderError(f"tensor {name!r}: data_offsets must be two non-negative integers")
    begin, end = offsets  # type: ignore[misc]
    if end < begin:
        raise HeaderError(f"tensor {name!r}: data_offsets end {end} is before begin {begin}")
    entry = TensorEntry(name, dtype, tuple(shape), begin, end)  # type: ignore[arg-type]
    bits = entry.numel * DTYPE_BITS[dtype]  # Python ints: no overflow to hide a bad shape
    if bits % 8:
        raise HeaderError(f"tensor {name!r}: {dtype} x {entry.numel} does not fill whole bytes")
    if bits // 8 != entry.nbytes:
        raise HeaderError(
            f"tensor {name!r}: shape {list(entry.shape)} of {dtype} needs {bits // 8} bytes, "
            f"data_offsets give {entry.nbytes}"
        )
    return entry


def _is_int_list(value: object) -> bool:
    return isinstance(value, list) and all(type(v) is int and 0 <= v < 2**64 for v in value)


def build_header(
    specs: Iterable[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, Header]:
    """Header bytes (8-byte length + JSON padded to 8) for tensors given as (name, dtype, shape).

    Layout as the reference writer's: sorted by dtype (descending enum order) then name, so every
    tensor starts at a multiple of its element size; the result is byte-identical to
    safetensors.torch.save_file for the same tensors and metadata of at most one key.
    """
    ordered = sorted(specs, key=lambda s: (-_DTYPE_RANK[s[1]], s[0]))
    doc: dict[str, object] = {}
    if metadata is not None:
        doc["__metadata__"] = metadata
    entries, offset = [], 0
    for name, dtype, shape in ordered:
        n = 1
        for d in shape:
            n *= d
        nbytes = n * DTYPE_BITS[dtype] // 8
        entries.append(TensorEntry(name, dtype, tuple(shape), offset, offset + nbytes))
        doc[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise HeaderError(f"header would be {len(text)} bytes, over the reader limit")
    header = Header(tuple(entries), metadata, 8 + len(text))
    return struct.pack("<Q", len(text)) + text, header
