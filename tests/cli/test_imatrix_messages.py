"""What an imatrix refusal says: an integer key llama-imatrix writes as UINT32 is read in any
integer type (a UINT64 imatrix.chunk_count was "no imatrix.chunk_count") and a non-integer one
is named with its type; a .dat value that is finite but whose sum over a chunk exceeds float32
is said so (not "infinite", which was qtool's own x512 in float32); and a .dat refused for its
structure says what to do (re-create it), not only what is wrong."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qtool.errors import InputError
from qtool.formats.imatrix import read_imatrix
from qtool.gguf_types import ValueType
from qtool.io.gguf_layout import GGUFValue
from tests.reliability.test_imatrix_hostile import META, ONE, TAIL, W, dat, f32, gguf_file, good

REDO = "re-create it with llama-imatrix or qtool calibrate"


def _line(path: Path) -> str:
    with pytest.raises(InputError) as info:
        read_imatrix(path)
    return str(info.value)


@pytest.mark.parametrize(
    "vtype",
    [ValueType.UINT64, ValueType.INT64, ValueType.INT32, ValueType.UINT16],
    ids=lambda t: t.name,
)
def test_any_integer_chunk_count_is_read(tmp_path: Path, vtype: ValueType) -> None:
    meta = {**META, "imatrix.chunk_count": GGUFValue(vtype, 7)}
    imatrix = read_imatrix(gguf_file(tmp_path / "m.gguf", good(), meta))
    assert imatrix.chunk_count == 7


def test_a_non_integer_chunk_count_is_named_with_its_type(tmp_path: Path) -> None:
    meta = {**META, "imatrix.chunk_count": GGUFValue(ValueType.STRING, "7")}
    line = _line(gguf_file(tmp_path / "m.gguf", good(), meta))
    assert "imatrix.chunk_count is a STRING, not an integer" in line and REDO in line, line


def test_a_finite_dat_value_whose_sum_overflows_is_not_called_infinite(tmp_path: Path) -> None:
    path = tmp_path / "big.dat"
    path.write_bytes(dat([(W.encode(), 1, 2, f32(3e36, 1).tobytes())], TAIL))
    line = _line(path)
    assert "infinite" not in line and "3e+36" in line and "exceeds float32" in line, line
    assert f"tensor {W!r}" in line and REDO in line, line


@pytest.mark.parametrize(
    "content",
    [
        dat([(W.encode(), -1, 4, bytes(16))]),
        dat([ONE, ONE]),
        dat([ONE], np.array([2, -3], "<i4").tobytes() + bytes(8)),
    ],
    ids=["negative-chunk-count", "twice", "negative-dataset-length"],
)
def test_dat_refusals_say_what_to_do(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.dat"
    path.write_bytes(content)
    line = _line(path)
    assert line.startswith(f"{path}: ") and REDO in line, line
