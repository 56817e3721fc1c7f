"""Importance matrices from a hostile or mistaken source: each bad GGUF imatrix or legacy .dat
is refused by read_imatrix with one InputError line naming the file (and the tensor or entry)
and what is wrong: truncation anywhere, counts negative, NaN or fractional, sums negative or
NaN, shapes that disagree (K, n_mat, dimensions), missing parts, sizes declared beyond the
file (refused before anything that size is allocated), a model or a FIFO given instead."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qtool.errors import InputError
from qtool.formats.imatrix import read_imatrix, write_imatrix
from qtool.gguf_types import ValueType
from qtool.io.gguf_layout import GGUFValue
from qtool.io.gguf_write import write_gguf
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats

META = {
    "general.type": GGUFValue(ValueType.STRING, "imatrix"),
    "imatrix.datasets": GGUFValue(ValueType.ARRAY, ("t.txt",), ValueType.STRING),
    "imatrix.chunk_count": GGUFValue(ValueType.UINT32, 1),
    "imatrix.chunk_size": GGUFValue(ValueType.UINT32, 512),
}
W = "blk.0.attn_q.weight"
UINT8 = ValueType.UINT8


def gguf_file(
    path: Path,
    tensors: dict[str, tuple[list[int], np.ndarray]],
    meta: dict[str, GGUFValue] | None = None,
    gtype: str = "F32",
) -> Path:
    """A valid GGUF container holding `tensors` (name: GGUF shape, data), whatever they mean."""
    specs = [(name, gtype, shape) for name, (shape, _) in tensors.items()]
    write_gguf(path, META if meta is None else meta, specs, [d for _, d in tensors.values()])
    return path


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def good(k: int = 4, n_mat: int = 1) -> dict[str, tuple[list[int], np.ndarray]]:
    return {
        f"{W}.in_sum2": ([k, n_mat], np.ones(k * n_mat, np.float32)),
        f"{W}.counts": ([1, n_mat], np.full(n_mat, 512, np.float32)),
    }


def refused(path: Path, expect: str, tensor: str | None = None) -> str:
    with pytest.raises(InputError) as info:
        read_imatrix(path)
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"{path}: "), line
    assert expect in line, (expect, line)
    if tensor is not None:
        assert f"tensor {tensor!r}" in line, line
    return line


GGUF_CASES = {
    "counts-negative": ({**good(), f"{W}.counts": ([1], f32(-512))}, "counts are numbers of rows"),
    "counts-nan": ({**good(), f"{W}.counts": ([1], f32(np.nan))}, "holds nan"),
    "counts-inf": ({**good(), f"{W}.counts": ([1], f32(np.inf))}, "holds inf"),
    "counts-fraction": ({**good(), f"{W}.counts": ([1], f32(2.5))}, "whole"),
    "counts-huge": ({**good(), f"{W}.counts": ([1], f32(1e30))}, "at most 2^53"),
    "sums-negative": ({**good(), f"{W}.in_sum2": ([4], f32(1, -1, 1, 1))}, "negative, NaN"),
    "sums-nan": ({**good(), f"{W}.in_sum2": ([4], f32(1, np.nan, 1, 1))}, "column 1: nan"),
    "sums-without-rows": ({**good(), f"{W}.counts": ([1], f32(0))}, "non-zero sums over 0 rows"),
    "n_mat-mismatch": (
        {f"{W}.in_sum2": ([2, 3], np.ones(6, np.float32)), f"{W}.counts": ([1, 2], f32(1, 1))},
        "holds 2 matrices, its in_sum2 3",
    ),
    "counts-not-one-column": (
        {**good(), f"{W}.counts": ([2], f32(1, 1))},
        "its in_sum2 needs [1, 1]",
    ),
    "in_sum-K-mismatch": (
        {**good(4), f"{W}.in_sum": ([5], np.zeros(5, np.float32))},
        "its in_sum2 needs [4, 1]",
    ),
    "three-dims": (
        {f"{W}.in_sum2": ([2, 2, 2], np.ones(8, np.float32)), f"{W}.counts": ([1], f32(1))},
        "llama-imatrix writes [K, n_mat]",
    ),
    "no-counts": ({f"{W}.in_sum2": ([4], np.ones(4, np.float32))}, f"has no {W}.counts"),
    "no-sums": ({f"{W}.counts": ([1], f32(1))}, f"has no {W}.in_sum2"),
    "stranger": ({**good(), "token_embd.weight": ([4], np.ones(4, np.float32))}, "is not <weight>"),
    "bare-suffix": ({**good(), ".counts": ([1], f32(1))}, "is not <weight>"),
    "no-tensors": ({}, "holds no statistics"),
}
TENSOR_OF = {
    "counts-negative": f"{W}.counts", "counts-nan": f"{W}.counts", "sums-nan": f"{W}.in_sum2",
    "n_mat-mismatch": f"{W}.counts", "in_sum-K-mismatch": f"{W}.in_sum",
    "three-dims": f"{W}.in_sum2", "stranger": "token_embd.weight",
}  # fmt: skip


@pytest.mark.parametrize("case", GGUF_CASES, ids=list(GGUF_CASES))
def test_bad_gguf_statistics_are_refused(case: str, tmp_path: Path) -> None:
    tensors, expect = GGUF_CASES[case]
    refused(gguf_file(tmp_path / "bad.gguf", tensors), expect, TENSOR_OF.get(case))


def test_f16_parts_are_refused(tmp_path: Path) -> None:
    half = np.ones(4, np.float16)
    tensors = {f"{W}.in_sum2": ([4], half), f"{W}.counts": ([1], half[:1])}
    refused(gguf_file(tmp_path / "f16.gguf", tensors, gtype="F16"), "llama-imatrix writes F32")


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ({"general.type": GGUFValue(ValueType.STRING, "model")}, "general.type 'model'"),
        ({"general.type": None}, "no general.type"),
        ({"imatrix.chunk_size": None}, "no imatrix.chunk_size"),
        ({"imatrix.chunk_size": GGUFValue(ValueType.FLOAT32, 512.0)}, "not an integer"),
        ({"imatrix.chunk_size": GGUFValue(ValueType.UINT32, 0)}, "chunk size 0"),
        ({"imatrix.chunk_count": None}, "no imatrix.chunk_count"),
        (
            {
                "imatrix.datasets": GGUFValue(
                    ValueType.ARRAY, np.zeros(1, np.uint8), ValueType.UINT8
                )
            },
            "must be an array of strings",
        ),
    ],
    ids=[
        "a-model",
        "no-type",
        "no-chunk-size",
        "float-chunk-size",
        "zero-chunk-size",
        "no-chunk-count",
        "datasets-not-strings",
    ],  # fmt: skip
)
def test_bad_metadata_is_refused(
    change: dict[str, GGUFValue | None], expect: str, tmp_path: Path
) -> None:
    meta = {k: v for k, v in (META | change).items() if v is not None}
    refused(gguf_file(tmp_path / "meta.gguf", good(), meta), expect)


def small_imatrix() -> ImportanceMatrix:
    stats = MatrixStats(np.ones((2, 4), np.float32), np.array([3, 5], np.int64))
    return ImportanceMatrix({W: stats, "blk.1.ffn_up.weight": stats}, 512, 0, ("t.txt",))


def test_a_truncated_gguf_is_refused_at_every_length(tmp_path: Path) -> None:
    write_imatrix(tmp_path / "full.gguf", small_imatrix())
    raw = (tmp_path / "full.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    data_end = len(raw) - 24  # the last tensor (2 counts, 8 bytes) and its padding to 32
    assert raw[data_end - 8 :] == struct.pack("<2f", 5, 5)[:0] + raw[
        data_end - 8 : data_end
    ] + bytes(24)
    for n in range(1, data_end):
        cut.write_bytes(raw[:n])
        refused(cut, "" if n < 4 else "not a valid GGUF file")


def dat(
    entries: list[tuple[bytes, int, int, bytes]], tail: bytes = b"", n: int | None = None
) -> bytes:
    """A legacy .dat: (name, ncall, nval, values) per entry, then `tail`."""
    out = struct.pack("<i", len(entries) if n is None else n)
    for name, ncall, nval, values in entries:
        out += struct.pack("<i", len(name)) + name + struct.pack("<ii", ncall, nval) + values
    return out + tail


ONE = (W.encode(), 2, 4, f32(1, 2, 3, 4).tobytes())
TAIL = struct.pack("<ii", 2, 5) + b"t.txt"
DAT_CASES = {
    "huge-entry-count": (dat([ONE], TAIL, n=2**31 - 1), "declares 2147483647 entries"),
    "zero-entries": (dat([], n=0), "declares 0 entries;"),
    "huge-name": (struct.pack("<ii", 1, 2**31 - 1) + bytes(20), "name of 2147483647 bytes"),
    "negative-name": (struct.pack("<ii", 1, -5) + bytes(20), "name of -5 bytes"),
    "huge-nval": (dat([(W.encode(), 2, 2**31 - 1, bytes(16))]), "declares 2147483647 values"),
    "zero-nval": (dat([(W.encode(), 2, 0, b"")], bytes(8)), "declares 0 values; an entry holds"),
    "negative-ncall": (dat([(W.encode(), -1, 4, bytes(16))]), "a chunk count of -1"),
    "nan-values": (dat([(W.encode(), 2, 2, f32(1, np.nan).tobytes())]), "negative, NaN"),
    "negative-values": (dat([(W.encode(), 2, 2, f32(1, -1).tobytes())]), "negative, NaN"),
    "values-without-chunks": (dat([(W.encode(), 0, 2, f32(1, 1).tobytes())]), "over 0 rows"),
    "overflow-when-scaled": (dat([(W.encode(), 1, 1, f32(3e38).tobytes())]), "exceeds float32"),
    "not-utf8-name": (dat([(b"\xff\xfe", 2, 1, f32(1).tobytes())]), "not UTF-8"),
    "nul-in-name": (dat([(b"a\0b", 2, 1, f32(1).tobytes())]), "holds a NUL"),
    "duplicate": (dat([ONE, ONE]), "appears twice"),
    "garbage-after": (dat([ONE], TAIL + b"x"), "1 bytes after the dataset name"),
    "short-trailer": (dat([ONE], b"\0\0"), "truncated: the chunk count at the end"),
    "huge-dataset": (dat([ONE], struct.pack("<ii", 2, 2**30)), "dataset name of 1073741824"),
    "a-safetensors-file": (
        struct.pack("<Q", 64) + b'{"w":{"dtype":"F32"}}' + bytes(50),
        "is it an importance matrix",
    ),
}


@pytest.mark.parametrize("case", DAT_CASES, ids=list(DAT_CASES))
def test_bad_dat_files_are_refused(case: str, tmp_path: Path) -> None:
    content, expect = DAT_CASES[case]
    path = tmp_path / "bad.dat"
    path.write_bytes(content)
    refused(path, expect)


def test_a_truncated_dat_is_refused_at_every_length(tmp_path: Path) -> None:
    raw = dat([ONE, (b"blk.1.ffn_up.weight", 2, 2, f32(1, 1).tobytes())], TAIL)
    path = tmp_path / "cut.dat"
    path.write_bytes(raw)
    assert len(read_imatrix(path).entries) == 2
    entries_end = len(raw) - len(TAIL)
    for n in range(1, len(raw)):
        if n in (entries_end, entries_end + 4):  # the trailer is optional (old files lack it)
            continue
        path.write_bytes(raw[:n])
        refused(path, "truncated" if n >= 4 else "")


def test_empty_and_special_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    refused(tmp_path / "empty", "is empty")
    os.mkfifo(tmp_path / "fifo")
    refused(tmp_path / "fifo", "not a regular file")
    refused(tmp_path / "missing", "no such file")


DECLARES_HUGE = """
import resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from qtool.errors import InputError
from qtool.formats.imatrix import read_imatrix
try:
    read_imatrix(Path(sys.argv[1]))
except InputError as err:
    print(err)
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is Linux's")
def test_declared_sizes_cost_nothing_before_they_are_checked(tmp_path: Path) -> None:
    """A .dat declaring 2^31 - 1 values (8 GiB) per entry, in a 1 GiB address space: refused
    by the check against the file, never by a failed allocation."""
    path = tmp_path / "huge.dat"
    path.write_bytes(dat([(W.encode(), 2, 2**31 - 1, bytes(64))]))
    res = subprocess.run(
        [sys.executable, "-c", DECLARES_HUGE, str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "declares 2147483647 values, more than the file holds" in res.stdout


def test_write_refuses_names_ggml_cannot_hold(tmp_path: Path) -> None:
    """ggml names hold 63 bytes; llama-imatrix would cut `<name>.in_sum2` short silently."""
    from qtool.errors import OutputError

    stats = MatrixStats(np.ones((1, 2), np.float32), np.ones(1, np.int64))
    long = "blk.0." + "x" * 50 + ".weight"
    with pytest.raises(OutputError, match="longer than ggml's 63 bytes"):
        write_imatrix(tmp_path / "o.gguf", ImportanceMatrix({long: stats}, 512, 0))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("change", ["touched", "truncated"])
def test_a_dat_changed_while_read_is_refused(
    change: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process rewrites the file between two entries: refused, never half-read."""
    from qtool.formats.imatrix import dat as dat_module

    path = tmp_path / "m.dat"
    path.write_bytes(dat([ONE, (b"blk.1.ffn_up.weight", 2, 2, f32(1, 1).tobytes())], TAIL))
    real = dat_module._entry

    def entry_then_change(cur: object, i: int) -> object:
        got = real(cur, i)  # type: ignore[arg-type]
        if i == 0 and change == "touched":
            os.utime(path, ns=(1, 1))
        elif i == 0:
            os.truncate(path, 40)
        return got

    monkeypatch.setattr(dat_module, "_entry", entry_then_change)
    refused(path, "changed while")


def test_the_dat_chunk_size_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "m.dat"
    path.write_bytes(dat([ONE], TAIL))
    for bad in (0, 2**31, 2**62):
        with pytest.raises(ValueError, match="chunk size"):
            read_imatrix(path, dat_chunk_size=bad)
    assert int(read_imatrix(path, dat_chunk_size=4096).entries[W].counts[0]) == 2 * 4096
