from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save, save_file

from qtool.io.stformat import Header, HeaderError, build_header, parse_header, read_header

ALL_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.float16,
    torch.bfloat16, torch.int32, torch.uint32, torch.float32, torch.float64, torch.int64,
    torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64,
]  # fmt: skip

ST_NAMES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.uint16: "U16", torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32",
    torch.uint32: "U32", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}  # fmt: skip


def _tensors() -> dict[str, torch.Tensor]:
    out = {f"t{i}.{dt}": torch.zeros(3, i + 1, dtype=dt) for i, dt in enumerate(ALL_DTYPES)}
    out["scalar"] = torch.tensor(1.5)
    out["empty"] = torch.zeros(0, 4)
    out["ünïcode name"] = torch.ones(2)
    return out


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}], ids=["no-metadata", "metadata"])
def test_build_header_is_byte_identical_to_safetensors(metadata: dict[str, str] | None) -> None:
    tensors = _tensors()
    reference = save(tensors, metadata=metadata)
    specs = [(n, ST_NAMES[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    header_bytes, header = build_header(specs, metadata)
    assert reference[: len(header_bytes)] == header_bytes
    assert len(reference) == header.data_start + header.data_bytes


def test_read_header_accepts_what_safetensors_writes(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    save_file(_tensors(), path, metadata={"k": "v"})
    header = read_header(path)
    assert header.metadata == {"k": "v"}
    assert {t.name for t in header.tensors} == set(_tensors())
    entry = header.by_name()["t9.torch.float32"]
    assert (entry.dtype, entry.shape, entry.nbytes) == ("F32", (3, 10), 120)


def _file(doc: object, data: bytes = b"", pad: bytes = b"") -> bytes:
    text = json.dumps(doc) if not isinstance(doc, bytes) else doc
    raw = (text.encode() if isinstance(text, str) else text) + pad
    return struct.pack("<Q", len(raw)) + raw + data


def _parse(blob: bytes) -> Header:
    n = struct.unpack("<Q", blob[:8])[0]
    return parse_header(blob[8 : 8 + n], len(blob))


def test_whitespace_padding_either_side_is_accepted() -> None:
    doc = {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}
    blob = _file(b"  " + json.dumps(doc).encode(), b"xy", pad=b"   \n")
    header = _parse(blob)
    assert [(t.name, t.dtype, t.shape, t.begin, t.end) for t in header.tensors] == [
        ("a", "U8", (2,), 0, 2)
    ]
    # The padding belongs to the header: the data starts after it, at the file's last 2 bytes.
    assert header.data_start == len(blob) - 2
    assert blob[header.data_start :] == b"xy"


@pytest.mark.parametrize(
    ("doc", "data", "message"),
    [
        ([1, 2], b"", "not a JSON object"),
        (
            {"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
            b"x" * 16,
            "unknown dtype",
        ),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"x" * 4, "shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"x" * 4, "needs 8 bytes"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"x" * 4, "before begin"),
        ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}, b"xx", "gap"),
        (
            {
                "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                "b": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
            },
            b"xx",
            "overlaps",
        ),
        ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"xyz", "trailing"),
        ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"xy", "truncated"),
        ({"__metadata__": {"k": 1}}, b"", "__metadata__"),
        ({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, b"x", "whole bytes"),
        ({"a": {"dtype": "U8", "shape": [2**31, 2**31], "data_offsets": [0, 0]}}, b"", "needs"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_malformed_headers_are_refused(doc: object, data: bytes, message: str) -> None:
    with pytest.raises(HeaderError, match=message):
        _parse(_file(doc, data))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"a": 1, "a": 2}', "duplicate"),
        (b'{"a": NaN}', "NaN"),
        (b'{"\\ud800": 1}', "surrogate"),
        (b"[" * 100_000, "nested|JSON"),
        (b"\xff\xfe", "UTF-8"),
        (b'{"a": 1}\x00\x00', "JSON"),
    ],
)
def test_json_laxities_are_refused(raw: bytes, message: str) -> None:
    with pytest.raises(HeaderError, match=message):
        parse_header(raw, 8 + len(raw))


OVERFLOWING_SHAPES = [
    [2**62, 2**62, 0],  # 0 elements, but the first two dims overflow before the zero
    [2**32, 2**32, 0],
    [2**62, 4, 0],
    [2**31, 2**31, 2**2, 0],
    [3, 2**62, 0, 5],
    [2**63, 0],  # one dim over int64
]
FITTING_SHAPES = [[0, 2**62, 2**62], [2**62, 0, 2**62], [2**31, 2**31, 0], [1, 2**62 + 1, 0]]


@pytest.mark.parametrize("shape", OVERFLOWING_SHAPES + FITTING_SHAPES, ids=str)
def test_shapes_whose_dims_overflow_in_order_are_refused(shape: list[int]) -> None:
    """Class: a shape read from a file whose running product of dims overflows a 64-bit count,
    whatever a later zero dim makes of the product. qtool refuses every one the reference parser
    refuses (and those torch cannot hold: int64); a zero before the large dims is a valid empty
    tensor to both."""
    from safetensors import deserialize

    raw = _file({"t": {"dtype": "U8", "shape": shape, "data_offsets": [0, 0]}}, b"")
    try:
        deserialize(raw)
        reference_refuses = False
    except Exception:  # the reference's SafetensorError
        reference_refuses = True
    if shape in OVERFLOWING_SHAPES:
        with pytest.raises(HeaderError, match=r"tensor 't': shape .* overflows"):
            _parse(raw)
    else:
        assert not reference_refuses
        n = struct.unpack("<Q", raw[:8])[0]
        assert parse_header(raw[8 : 8 + n], len(raw)).tensors[0].shape == tuple(shape)
    if reference_refuses:
        assert shape in OVERFLOWING_SHAPES


def test_zero_size_tensor_may_share_an_offset() -> None:
    doc = {
        "a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]},
        "b": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
    }
    header = _parse(_file(doc, b"xy"))
    entries = header.by_name()
    assert (entries["a"].begin, entries["a"].end, entries["a"].nbytes) == (0, 0, 0)
    assert (entries["b"].begin, entries["b"].end, entries["b"].nbytes) == (0, 2, 2)
