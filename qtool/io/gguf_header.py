"""The GGUF container (llama.cpp): a bounded parser for hostile files and the header values.

Layout (little-endian): "GGUF", version u32, n_tensors u64, n_kv u64, the key/value pairs
(key string, value type u32, value), the tensor infos (name string, n_dims u32, ne u64 x
n_dims, ggml type u32, offset u64), zero padding to the alignment, then the tensor data, each
tensor at the aligned end of the one before. A string is a u64 length and UTF-8 bytes.

The checks are ggml's own (gguf.cpp gguf_init_from_reader and llama.cpp's loader: versions 2
and 3, unique non-empty keys, unique names under 64 bytes, at most 4 dims, known types, rows
whole blocks, offsets exactly where ggml expects them, data inside the file) plus bounds that
keep work and memory proportional to the file and small (docs/reliability.md, "GGUF"): every
count and length is checked against the bytes left before anything is allocated, tensors and
keys are at most MAX_TENSORS and MAX_KEYS, names are not empty, the non-zero dimensions of a
shape multiply to at most INT64_MAX in any order, the alignment is at most MAX_ALIGNMENT,
strings must be UTF-8, arrays of arrays are refused (ggml refuses them too), and string arrays
are capped in total. Each entry is parsed once, its messages built only on failure (a header
that runs past the prefix read so far asks for more and goes on). Torch-free; numeric arrays
are numpy.
"""

from __future__ import annotations

import codecs
import struct
from collections.abc import Callable

import numpy as np

from qtool.gguf_types import (
    ALIGNMENT_KEY,
    GGML_TYPES_BY_ID,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLType,
    ValueType,
)
from qtool.io.gguf_layout import (
    GGUFHeader,
    GGUFTensorInfo,
    GGUFValue,
    align,
    tensor_nbytes,
)

MAX_NAME_BYTES = 63  # GGML_MAX_NAME - 1
MAX_DIMS = 4
MAX_STRING_BYTES = 1 << 30  # GGUF_MAX_STRING_LENGTH
MAX_ARRAY_ITEMS = 1 << 30  # GGUF_MAX_ARRAY_ELEMENTS
MAX_STRINGS = 1 << 22  # strings in all arrays together (a vocabulary and its merges: < 1M)
MAX_TENSORS = 1 << 16  # the largest published GGUFs hold a few thousand (DeepSeek-V3: ~1,100)
MAX_KEYS = 1 << 16  # key/value pairs: real files hold 20-60 (a vocabulary is one array)
MAX_ALIGNMENT = 1 << 16  # llama.cpp writes 32; a page is 4-64 KiB
MAX_KEY_BYTES = 1 << 10  # real keys are under 100 bytes; messages quote them
INT64_MAX = (1 << 63) - 1
MIN_INFO_BYTES = 8 + 1 + 4 + 4 + 8  # name length, a 1-byte name, n_dims, type, offset
MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, a 1-byte key, value type, a 1-byte value

Fetch = Callable[[int], memoryview]
"""Given n, the first n bytes (at least) of the file: how a parse reads on past its prefix."""
What = str | Callable[[], str]


class GGUFHeaderError(ValueError):
    """The bytes are not a valid GGUF file; the message says what is wrong and where."""


class NeedMore(Exception):
    """The header runs past the prefix of the file given: parse again with `needed` bytes."""

    def __init__(self, needed: int) -> None:
        super().__init__(f"the header needs the first {needed} bytes of the file")
        self.needed = needed


class _Cursor:
    """Reads little-endian fields from `buf`, the first bytes of a `size`-byte file, refusing
    any that runs past the file's end; past the prefix it asks `fetch` for more (NeedMore
    without one). `what` names the field for messages; a callable is only called on failure,
    so a well-formed entry costs no formatting."""

    def __init__(self, buf: memoryview, size: int, fetch: Fetch | None = None) -> None:
        self.buf, self.size, self.pos, self.n_strings = buf, size, 0, 0
        self._fetch = fetch

    def left(self) -> int:
        """Bytes of the file left (what declared counts and lengths are bounded by)."""
        return self.size - self.pos

    def _more(self, needed: int) -> None:
        if self._fetch is None:
            raise NeedMore(needed)
        buf = self._fetch(needed)
        if len(buf) < needed:
            raise NeedMore(needed)
        self.buf = buf

    def take(self, n: int, what: What) -> memoryview:
        if n > self.left():
            raise GGUFHeaderError(
                f"truncated: {_text(what)} at byte {self.pos} needs {n} bytes, "
                f"{self.left()} are left"
            )
        if self.pos + n > len(self.buf):
            self._more(self.pos + n)
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def unpack(self, st: struct.Struct, what: What) -> tuple[int | float | bool, ...]:
        if self.pos + st.size <= len(self.buf) and st.size <= self.left():
            self.pos += st.size
            return st.unpack_from(self.buf, self.pos - st.size)
        return st.unpack(self.take(st.size, what))

    def scalar(self, fmt: str, what: What) -> int | float | bool:
        return self.unpack(_struct(fmt), what)[0]

    def u32(self, what: What) -> int:
        return int(self.unpack(_U32, what)[0])

    def u64(self, what: What) -> int:
        return int(self.unpack(_U64, what)[0])

    def string(self, what: What, limit: int = MAX_STRING_BYTES) -> str:
        n = self.u64(lambda: f"the length of {_text(what)}")
        if n > limit:
            raise GGUFHeaderError(f"{_text(what)} is {n} bytes long, over the {limit}-byte limit")
        raw = self.take(n, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as err:
            raise GGUFHeaderError(f"{_text(what)} is not UTF-8 (byte {err.start})") from None

    def strings(self, n: int, key: str) -> tuple[str, ...]:
        """n strings in a row (a vocabulary: the loop of `string`, without its per-item cost)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        out: list[str] = []
        append, decode = out.append, codecs.utf_8_decode
        for j in range(n):
            start = pos + 8
            length = _LENGTH(buf, pos)[0] if start <= end else -1
            stop = start + length
            if length < 0 or length > MAX_STRING_BYTES or stop > end:
                self.pos = pos
                append(self.string(f"item {j} of {key!r}"))  # reads on, or says what is wrong
                buf, pos, end = self.buf, self.pos, len(self.buf)
                continue
            try:
                append(decode(buf[start:stop], "strict", True)[0])
            except UnicodeDecodeError as err:
                raise GGUFHeaderError(
                    f"item {j} of {key!r} is not UTF-8 (byte {err.start})"
                ) from None
            pos = stop
        self.pos = pos
        return tuple(out)


def _text(what: What) -> str:
    return what if isinstance(what, str) else what()


_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_STRUCTS: dict[str, struct.Struct] = {}


def _struct(fmt: str) -> struct.Struct:
    found = _STRUCTS.get(fmt)
    if found is None:
        found = _STRUCTS[fmt] = struct.Struct(fmt)
    return found


_LENGTH = struct.Struct("<Q").unpack_from


def parse_header(
    buf: memoryview, file_size: int | None = None, fetch: Fetch | None = None
) -> GGUFHeader:
    """Validate the GGUF file of `file_size` bytes (default: all of `buf`) whose first bytes
    are `buf`: GGUFHeaderError if it is bad; if its header runs past `buf`, the parse goes on
    in the longer prefix `fetch` gives, or raises NeedMore without one."""
    size = len(buf) if file_size is None else file_size
    cur = _Cursor(buf, size, fetch)
    if len(buf) < min(4, size):
        raise NeedMore(min(4, size))
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise GGUFHeaderError(f"not a GGUF file: it starts with {bytes(buf[:4])!r}, not b'GGUF'")
    cur.take(4, "the magic")
    version = _version(cur.u32("the version"))
    n_tensors = _count(cur.u64("the tensor count"), "tensors", cur, MIN_INFO_BYTES, MAX_TENSORS)
    n_kv = _count(cur.u64("the key/value count"), "key/value pairs", cur, MIN_KV_BYTES, MAX_KEYS)
    metadata = _metadata(cur, n_kv)
    alignment = _alignment(metadata)
    infos = [_tensor_info(cur, i) for i in range(n_tensors)]
    _unique([name for name, *_ in infos], "tensor name")
    data_start = align(cur.pos, alignment) if infos else cur.pos
    return GGUFHeader(version, metadata, _place(infos, alignment, data_start, size),
                      alignment, data_start)  # fmt: skip


def _version(version: int) -> int:
    if version & 0xFFFF == 0 and version:
        raise GGUFHeaderError(
            f"version field {version:#x}: a big-endian GGUF file (llama.cpp reads little-endian)"
        )
    if version == 1:
        raise GGUFHeaderError("GGUF version 1 is no longer supported by llama.cpp; reconvert it")
    if version not in (2, 3):
        raise GGUFHeaderError(f"unsupported GGUF version {version} (qtool reads 2 and 3)")
    return version


def _count(n: int, what: str, cur: _Cursor, min_bytes: int, limit: int) -> int:
    """A declared count, refused when over `limit` or when even the smallest entries could
    not fit in the bytes left."""
    if n * min_bytes > cur.left():
        raise GGUFHeaderError(f"declares {n} {what}, more than the {cur.size}-byte file holds")
    if n > limit:
        raise GGUFHeaderError(f"declares {n:,} {what}, over qtool's limit of {limit:,}")
    return n


def _metadata(cur: _Cursor, n_kv: int) -> dict[str, GGUFValue]:
    metadata: dict[str, GGUFValue] = {}
    for i in range(n_kv):
        key = cur.string(lambda: f"key {i}", limit=MAX_KEY_BYTES)  # noqa: B023 (called at once)
        if not key:
            raise GGUFHeaderError(f"key {i} is empty")
        if key in metadata:
            raise GGUFHeaderError(f"duplicate key {key!r}")
        metadata[key] = _value(cur, key)
    return metadata


def _value_type(raw: int, key: str) -> ValueType:
    try:
        return ValueType(raw)
    except ValueError:
        raise GGUFHeaderError(f"key {key!r} has unknown value type {raw}") from None


def _value(cur: _Cursor, key: str) -> GGUFValue:
    vtype = _value_type(cur.u32(lambda: f"the type of {key!r}"), key)
    if vtype is ValueType.STRING:
        return GGUFValue(vtype, cur.string(lambda: f"the value of {key!r}"))
    if vtype is not ValueType.ARRAY:
        return GGUFValue(vtype, cur.scalar(vtype.struct_format, lambda: f"the value of {key!r}"))
    item = _value_type(cur.u32(lambda: f"the item type of {key!r}"), key)
    n = cur.u64(lambda: f"the length of {key!r}")
    if item is ValueType.ARRAY:
        raise GGUFHeaderError(f"key {key!r} is an array of arrays, which llama.cpp cannot read")
    size = 8 if item is ValueType.STRING else struct.calcsize(item.struct_format)
    if n > MAX_ARRAY_ITEMS or n * size > cur.left():
        raise GGUFHeaderError(f"key {key!r} declares {n} items, more than the file holds")
    if item is ValueType.STRING:
        cur.n_strings += n
        if cur.n_strings > MAX_STRINGS:
            raise GGUFHeaderError(f"more than {MAX_STRINGS} strings in arrays (at key {key!r})")
        return GGUFValue(vtype, cur.strings(n, key), item)
    raw = cur.take(n * size, lambda: f"the items of {key!r}")
    array = np.frombuffer(raw, dtype=item.struct_format.replace("?", "b")).copy()
    array = array.astype(bool) if item is ValueType.BOOL else array
    array.flags.writeable = False
    return GGUFValue(vtype, array, item)


def _alignment(metadata: dict[str, GGUFValue]) -> int:
    found = metadata.get(ALIGNMENT_KEY)
    if found is None:
        return GGUF_DEFAULT_ALIGNMENT
    if found.type is not ValueType.UINT32:
        raise GGUFHeaderError(f"{ALIGNMENT_KEY} must be a UINT32, not {found.type.name}")
    alignment = int(found.value)  # type: ignore[arg-type]
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFHeaderError(f"{ALIGNMENT_KEY} {alignment} is not a power of 2")
    if alignment > MAX_ALIGNMENT:
        raise GGUFHeaderError(
            f"{ALIGNMENT_KEY} {alignment} is over qtool's limit of {MAX_ALIGNMENT} (llama.cpp "
            "writes 32): every tensor would be padded to it"
        )
    return alignment


_Info = tuple[str, GGMLType, tuple[int, ...], int]


def _tensor_info(cur: _Cursor, i: int) -> _Info:
    name = cur.string(lambda: f"the name of tensor {i}", limit=1 << 16)
    if not name:
        raise GGUFHeaderError(f"tensor {i} has an empty name")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise GGUFHeaderError(f"tensor {name!r}: name longer than ggml's {MAX_NAME_BYTES} bytes")
    n_dims = cur.u32(lambda: f"the dimension count of {name!r}")
    if n_dims > MAX_DIMS:
        raise GGUFHeaderError(f"tensor {name!r}: {n_dims} dimensions, ggml allows {MAX_DIMS}")
    shape = tuple(int(d) for d in cur.unpack(_DIMS[n_dims], lambda: f"a dimension of {name!r}"))
    _check_shape(name, shape)
    type_id = cur.u32(lambda: f"the type of {name!r}")
    if type_id not in GGML_TYPES_BY_ID:
        raise GGUFHeaderError(f"tensor {name!r}: unknown ggml type {type_id}")
    ggml = GGML_TYPES_BY_ID[type_id]
    if (shape[0] if shape else 1) % ggml.block_size:
        raise GGUFHeaderError(
            f"tensor {name!r}: rows of {shape[0]} are not whole {ggml.name} blocks "
            f"of {ggml.block_size}"
        )
    return name, ggml, shape, cur.u64(lambda: f"the offset of {name!r}")


_DIMS = [struct.Struct(f"<{n}q") for n in range(MAX_DIMS + 1)]


def _check_shape(name: str, shape: tuple[int, ...]) -> None:
    """No negative dimension, and the non-zero ones multiply to at most INT64_MAX: whatever the
    order and the zeros, no running product of the shape (GGUF's order or torch's, as a
    safetensors or torch reader computes it) overflows int64."""
    numel = 1
    for d in shape:
        if d < 0 or (d and numel > INT64_MAX // d):
            raise GGUFHeaderError(
                f"tensor {name!r}: shape {list(shape)} is negative or too big (its non-zero "
                "dimensions multiply to more than 2^63 - 1)"
            )
        numel *= d or 1


def _unique(names: list[str], what: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise GGUFHeaderError(f"duplicate {what} {name!r}")
        seen.add(name)


def _place(
    infos: list[_Info], alignment: int, data_start: int, file_size: int
) -> tuple[GGUFTensorInfo, ...]:
    """Tensor infos with their sizes, each at the offset ggml expects and inside the file."""
    placed, expected = [], 0
    for name, ggml, shape, offset in infos:
        nbytes = tensor_nbytes(ggml, shape)
        if offset != expected:
            raise GGUFHeaderError(
                f"tensor {name!r}: data offset {offset}, but tensors follow one another in "
                f"order at {alignment}-byte alignment, so it must be {expected}"
            )
        if data_start + offset + nbytes > file_size:
            raise GGUFHeaderError(
                f"truncated: tensor {name!r} ends at byte {data_start + offset + nbytes} "
                f"of a {file_size}-byte file"
            )
        placed.append(GGUFTensorInfo(name, ggml, shape, offset, nbytes))
        expected = align(offset + nbytes, alignment)
    return tuple(placed)
