"""llama-imatrix's GGUF format: read (validated), and written as llama-imatrix writes it.

A GGUF file of `general.type` "imatrix" with the keys `imatrix.datasets` (array of strings),
`imatrix.chunk_count` and `imatrix.chunk_size` (UINT32) in that order, and per weight, in
byte order of the names: `<name>.in_sum2` F32 of GGUF shape [K, n_mat], `<name>.counts` F32
[1, n_mat] and, from newer llama-imatrix versions, `<name>.in_sum` F32 [K, n_mat]; trailing
dimensions of 1 are not written (ggml_n_dims), so a plain Linear's are [K] and [1].
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np

from qtool.errors import InputError, OutputError
from qtool.gguf_types import ValueType
from qtool.io.gguf_file import GGUFFile
from qtool.io.gguf_header import MAX_NAME_BYTES
from qtool.io.gguf_layout import GGUFHeader, GGUFTensorInfo, GGUFValue
from qtool.io.gguf_write import Buffer, TensorSpec, write_gguf
from qtool.numerics.imatrix import MAX_COUNT, ImportanceMatrix, MatrixStats

TYPE_KEY, DATASETS, CHUNK_COUNT, CHUNK_SIZE = (
    "general.type", "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size",
)  # fmt: skip
SUM2, COUNTS, SUM = ".in_sum2", ".counts", ".in_sum"
_PARTS = (SUM2, COUNTS, SUM)


def read_gguf(path: Path) -> ImportanceMatrix:
    """The statistics of a GGUF imatrix file; InputError naming the file (and tensor) for
    anything llama-imatrix would not have written."""
    return read_gguf_from(path, None)[0]


def read_gguf_from(
    path: Path, file: BinaryIO | None
) -> tuple[ImportanceMatrix, Mapping[str, GGUFValue]]:
    """read_gguf of `path` as `file` holds it (None: opened here; else taken over and closed),
    with the file's metadata."""
    with GGUFFile(path, file) as f:
        chunk_size, chunk_count, datasets = _metadata(f.header, path)
        entries = {name: _entry(f, name, parts) for name, parts in _group(f.header, path).items()}
        f.check_unchanged()
        meta = f.header.metadata
    try:
        return ImportanceMatrix(entries, chunk_size, chunk_count, datasets), meta
    except ValueError as err:
        raise InputError(path, f"not a usable importance matrix: {err}") from None


def _metadata(header: GGUFHeader, path: Path) -> tuple[int, int, tuple[str, ...]]:
    kind = header.metadata.get(TYPE_KEY)
    if kind is None or kind.value != "imatrix":
        what = "no general.type" if kind is None else f"general.type {kind.value!r:.40}"
        raise InputError(path, f"not an importance matrix ({what}; llama-imatrix writes "
                         "'imatrix'); give a file written by llama-imatrix or qtool")  # fmt: skip
    datasets = header.metadata.get(DATASETS)
    if datasets is not None and datasets.item_type is not ValueType.STRING:
        raise InputError(path, f"{DATASETS} must be an array of strings")
    names = datasets.value if datasets is not None else ()
    if not isinstance(names, tuple):  # the parser gives string arrays as tuples
        raise InputError(path, f"{DATASETS} must be an array of strings")
    return _u32(header, CHUNK_SIZE, path), _u32(header, CHUNK_COUNT, path), names


_INTEGERS = frozenset(ValueType[t] for t in (
    "UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64",
))  # fmt: skip


def _u32(header: GGUFHeader, key: str, path: Path) -> int:
    """The integer at `key`: llama-imatrix writes a UINT32, any integer type is read (its range
    is ImportanceMatrix's to check)."""
    found = header.metadata.get(key)
    if found is None:
        raise InputError(path, f"no {key} (a UINT32, which llama-imatrix writes); re-create "
                         "it with llama-imatrix or qtool calibrate")  # fmt: skip
    if found.type not in _INTEGERS:
        raise InputError(path, f"{key} is a {found.type.name}, not an integer (llama-imatrix "
                         "writes a UINT32); re-create it with llama-imatrix or qtool "
                         "calibrate")  # fmt: skip
    return int(found.value)  # type: ignore[arg-type]


def _group(header: GGUFHeader, path: Path) -> dict[str, dict[str, GGUFTensorInfo]]:
    """The tensors by weight name and part, each part F32 and present once per weight."""
    groups: dict[str, dict[str, GGUFTensorInfo]] = {}
    for info in header.tensors:
        part = next((p for p in _PARTS if info.name.endswith(p)), None)
        name = info.name[: -len(part)] if part else ""
        if not name or part is None:
            why = "is not <weight>.in_sum2, .counts or .in_sum; is this an importance matrix?"
            raise InputError(path, why, info.name)
        if info.type.name != "F32":
            raise InputError(path, f"is {info.type.name}; llama-imatrix writes F32", info.name)
        groups.setdefault(name, {})[part] = info
    for name, parts in groups.items():
        if SUM2 not in parts or COUNTS not in parts:
            missing = SUM2 if SUM2 not in parts else COUNTS
            raise InputError(
                path, f"has no {name}{missing} beside it", next(iter(parts.values())).name
            )
    return groups


def _entry(f: GGUFFile, name: str, parts: dict[str, GGUFTensorInfo]) -> MatrixStats:
    sum2, counts = parts[SUM2], parts[COUNTS]
    k, n_mat = _dims(f.path, sum2, None)
    _dims(f.path, counts, n_mat, ones=True)
    sums = f.tensor_array(sum2).reshape(n_mat, k)
    raw = f.tensor_array(counts).reshape(n_mat)
    whole = np.isfinite(raw) & (raw >= 0) & (raw <= MAX_COUNT) & (np.floor(raw) == raw)
    if not whole.all():
        bad = raw[~whole][0]
        raise InputError(f.path, f"holds {bad}: counts are numbers of rows, whole, not "
                         f"negative and at most 2^53", counts.name)  # fmt: skip
    in_sum = None
    if SUM in parts:
        _dims(f.path, parts[SUM], n_mat, k=k)
        in_sum = f.tensor_array(parts[SUM]).reshape(n_mat, k)
    try:
        return MatrixStats(sums, raw.astype(np.int64), in_sum)
    except ValueError as err:
        raise InputError(f.path, f"not usable statistics: {err}", sum2.name) from None


def _dims(
    path: Path, info: GGUFTensorInfo, n_mat: int | None, k: int | None = None, ones: bool = False
) -> tuple[int, int]:
    """(K, n_mat) of a [K, n_mat] part (ones: a counts part, K = 1), checked against the
    in_sum2 beside it."""
    shape = info.shape + (1,) * (2 - len(info.shape))
    want = f"[{'1' if ones else 'K'}, n_mat]"
    if len(shape) != 2 or 0 in shape:
        raise InputError(path, f"has shape {list(info.shape)}; llama-imatrix writes {want}",
                         info.name)  # fmt: skip
    if (ones and shape[0] != 1) or (k is not None and shape[0] != k):
        raise InputError(path, f"has shape {list(info.shape)}; its in_sum2 needs "
                         f"[{1 if ones else k}, {n_mat}]", info.name)  # fmt: skip
    if n_mat is not None and shape[1] != n_mat:
        raise InputError(path, f"holds {shape[1]} matrices, its in_sum2 {n_mat}", info.name)
    return shape[0], shape[1]


def write_gguf_imatrix(
    path: Path, imatrix: ImportanceMatrix, extra: Mapping[str, GGUFValue] | None = None
) -> None:
    """Write `imatrix` to `path` (a temp file renamed into place) byte for byte as
    llama-imatrix would; `extra` metadata keys (qtool's provenance) after llama-imatrix's, which
    llama-quantize's loader skips (it looks its keys up by name). The caller checks the output
    path first (io.atomic.preflight)."""
    names = sorted(imatrix.entries)
    for name in names:
        if len(f"{name}{SUM2}".encode()) > MAX_NAME_BYTES:
            raise OutputError(path, f"cannot be written: {name}{SUM2} is longer than ggml's "
                              f"{MAX_NAME_BYTES} bytes", name)  # fmt: skip
    metadata = {
        TYPE_KEY: GGUFValue(ValueType.STRING, "imatrix"),
        DATASETS: GGUFValue(ValueType.ARRAY, tuple(imatrix.datasets), ValueType.STRING),
        CHUNK_COUNT: GGUFValue(ValueType.UINT32, imatrix.chunk_count),
        CHUNK_SIZE: GGUFValue(ValueType.UINT32, imatrix.chunk_size),
    } | dict(extra or {})
    specs: list[TensorSpec] = []
    for name in names:
        s = imatrix.entries[name]
        specs += [(name + SUM2, "F32", _ggml_dims(s.k, s.n_mat)),
                  (name + COUNTS, "F32", _ggml_dims(1, s.n_mat))]  # fmt: skip
        if s.in_sum is not None:
            specs.append((name + SUM, "F32", _ggml_dims(s.k, s.n_mat)))
    write_gguf(path, metadata, specs, _datas(imatrix, names))


def _ggml_dims(ne0: int, ne1: int) -> tuple[int, ...]:
    """ggml_n_dims: a trailing dimension of 1 is not written."""
    return (ne0,) if ne1 == 1 else (ne0, ne1)


def _datas(imatrix: ImportanceMatrix, names: list[str]) -> Iterator[Buffer]:
    for name in names:
        s = imatrix.entries[name]
        yield s.sums
        yield s.counts.astype(np.float32)  # (float) count, as llama-imatrix converts it
        if s.in_sum is not None:
            yield s.in_sum
