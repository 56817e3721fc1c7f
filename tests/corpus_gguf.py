"""A generated corpus of bad GGUF files: each case is the file's bytes and a substring the one
error about it must contain. Built by hand field by field, so each breaks exactly one rule."""

from __future__ import annotations

import struct
from dataclasses import dataclass

STRING, ARRAY, UINT8, UINT32 = 8, 9, 0, 4
F32, Q4_K = 0, 12


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def kv_u32(key: str, value: int) -> bytes:
    return kv(key, UINT32, struct.pack("<I", value))


def ti(name: str | bytes, dims: list[int], gtype: int = F32, offset: int = 0) -> bytes:
    packed = struct.pack(f"<I{len(dims)}q", len(dims), *dims)
    return s(name) + packed + struct.pack("<IQ", gtype, offset)


def gguf(
    kvs: list[bytes] = (),  # type: ignore[assignment]
    infos: list[bytes] = (),  # type: ignore[assignment]
    data: bytes = b"",
    *,
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
) -> bytes:
    """A GGUF file; the data section starts at the next multiple of 32 when there are infos."""
    nt = len(infos) if n_tensors is None else n_tensors
    nk = len(kvs) if n_kv is None else n_kv
    head = b"GGUF" + struct.pack("<IQQ", version, nt, nk) + b"".join(kvs) + b"".join(infos)
    if infos:
        head += bytes(-len(head) % 32)
    return head + data


@dataclass(frozen=True)
class GGUFCase:
    id: str
    content: bytes
    expect: str


W = ti("w", [4, 2])  # F32 (2, 4): 32 bytes
DATA = bytes(32)
CASES = [
    GGUFCase("empty", b"", "empty"),
    GGUFCase("safetensors", struct.pack("<Q", 2) + b"{}", "not a GGUF file"),
    GGUFCase("magic-only", b"GGUF", "truncated: the version"),
    GGUFCase("truncated-counts", gguf()[:12], "truncated: the tensor count"),
    GGUFCase("version-1", gguf(version=1), "version 1 is no longer supported"),
    GGUFCase("version-4", gguf(version=4), "unsupported GGUF version 4"),
    GGUFCase("version-0", gguf(version=0), "unsupported GGUF version 0"),
    GGUFCase("big-endian", gguf(version=3 << 24), "big-endian"),
    GGUFCase("huge-n-tensors", gguf(n_tensors=2**63), "declares 9223372036854775808 tensors"),
    GGUFCase("huge-n-kv", gguf(n_kv=2**40), "key/value pairs, more than"),
    GGUFCase("n-kv-past-end", gguf([kv_u32("a", 1)], n_kv=2), "declares 2 key/value pairs"),
    GGUFCase("value-truncated", gguf([kv("a", UINT32, b"\x01")]), "truncated: the value of 'a'"),
    GGUFCase(
        "huge-key-length", gguf([struct.pack("<Q", 2**62) + bytes(16)]), "over the 1024-byte limit"
    ),
    GGUFCase("key-past-end", gguf([struct.pack("<Q", 100) + b"abcdefgh"]), "truncated: key 0"),
    GGUFCase("empty-key", gguf([kv("", UINT32, bytes(4))]), "key 0 is empty"),
    GGUFCase("duplicate-key", gguf([kv_u32("a", 1), kv_u32("a", 2)]), "duplicate key 'a'"),
    GGUFCase("unknown-value-type", gguf([kv("a", 99, bytes(8))]), "unknown value type 99"),
    GGUFCase("non-utf8-key", gguf([kv(b"k\xff", UINT32, bytes(4))]), "key 0 is not UTF-8"),
    GGUFCase(
        "non-utf8-value", gguf([kv("a", STRING, s(b"\xc3\x28"))]), "value of 'a' is not UTF-8"
    ),
    GGUFCase(
        "non-utf8-array-item",
        gguf([kv("a", ARRAY, struct.pack("<IQ", STRING, 2) + s("ok") + s(b"\x80"))]),
        "item 1 of 'a' is not UTF-8",
    ),
    GGUFCase(
        "huge-array",
        gguf([kv("a", ARRAY, struct.pack("<IQ", UINT8, 2**40))]),
        "declares 1099511627776 items",
    ),
    GGUFCase(
        "huge-string-array",
        gguf([kv("a", ARRAY, struct.pack("<IQ", STRING, 2**33) + bytes(64))]),
        "declares 8589934592 items",
    ),
    GGUFCase(
        "deep-array",
        gguf([kv("a", ARRAY, struct.pack("<IQ", ARRAY, 1) + struct.pack("<IQ", ARRAY, 1) * 50)]),
        "array of arrays",
    ),
    GGUFCase(
        "array-unknown-item",
        gguf([kv("a", ARRAY, struct.pack("<IQ", 77, 1))]),
        "unknown value type 77",
    ),
    GGUFCase(
        "alignment-type", gguf([kv("general.alignment", STRING, s("32"))]), "must be a UINT32"
    ),
    GGUFCase("alignment-48", gguf([kv_u32("general.alignment", 48)]), "48 is not a power of 2"),
    GGUFCase("alignment-0", gguf([kv_u32("general.alignment", 0)]), "0 is not a power of 2"),
    GGUFCase("name-too-long", gguf(infos=[ti("n" * 64, [4])], data=DATA), "longer than ggml"),
    GGUFCase("non-utf8-name", gguf(infos=[ti(b"w\xfe", [4])], data=DATA), "is not UTF-8"),
    GGUFCase(
        "duplicate-tensor", gguf(infos=[W, ti("w", [4, 2], offset=32)], data=DATA * 2), "duplicate"
    ),
    GGUFCase("five-dims", gguf(infos=[ti("w", [1] * 5)], data=DATA), "5 dimensions"),
    GGUFCase("negative-dim", gguf(infos=[ti("w", [4, -2])], data=DATA), "negative or too big"),
    GGUFCase(
        "numel-overflow", gguf(infos=[ti("w", [2**32, 2**32])], data=DATA), "negative or too big"
    ),
    GGUFCase("unknown-type", gguf(infos=[ti("w", [4], gtype=99)], data=DATA), "unknown ggml type"),
    GGUFCase("removed-type", gguf(infos=[ti("w", [32], gtype=4)], data=DATA), "unknown ggml type"),
    GGUFCase(
        "partial-blocks",
        gguf(infos=[ti("w", [100, 2], gtype=Q4_K)], data=bytes(288)),
        "not whole Q4_K blocks of 256",
    ),
    GGUFCase("misaligned", gguf(infos=[ti("w", [4, 2], offset=4)], data=DATA * 2), "must be 0"),
    GGUFCase(
        "overlap",
        gguf(infos=[W, ti("v", [4, 2], offset=16)], data=DATA * 2),
        "data offset 16, but tensors follow one another in order",
    ),
    GGUFCase("gap", gguf(infos=[W, ti("v", [4, 2], offset=64)], data=DATA * 3), "offset 64, but"),
    GGUFCase(
        "out-of-order",
        gguf(infos=[ti("w", [4, 2], offset=32), ti("v", [4, 2])], data=DATA * 2),
        "offset 32, but",
    ),
    GGUFCase("data-truncated", gguf(infos=[W], data=DATA[:31]), "ends at byte"),
    GGUFCase("tensor-far-away", gguf(infos=[ti("w", [2**40, 2**20])], data=DATA), "ends at byte"),
    GGUFCase("infos-truncated", gguf(infos=[W])[:60], "truncated: the offset of 'w'"),
    # issue 28: bounds on work, and names and shapes no consumer could take
    GGUFCase("long-key", gguf([kv_u32("k" * 1025, 1)]), "key 0 is 1025 bytes long, over the 1024"),
    GGUFCase("empty-tensor-name", gguf(infos=[ti("", [4, 2])], data=DATA), "tensor 0 has an empty"),
    GGUFCase(
        "overflow-after-a-zero",  # torch order [2^62, 2^62, 0]: its running product overflows
        gguf(infos=[ti("w", [0, 2**62, 2**62])]),
        "non-zero dimensions multiply to more than 2^63 - 1",
    ),
    GGUFCase(
        "alignment-2^30",
        gguf([kv_u32("general.alignment", 1 << 30)], infos=[W], data=DATA),
        "1073741824 is over qtool's limit of 65536",
    ),
    GGUFCase(
        "too-many-tensors",
        gguf(n_tensors=65_537) + bytes(65_537 * 25),
        "declares 65,537 tensors, over qtool's limit of 65,536",
    ),
    GGUFCase(
        "too-many-keys",
        gguf(n_kv=65_537) + bytes(65_537 * 14),
        "declares 65,537 key/value pairs, over qtool's limit of 65,536",
    ),
]
