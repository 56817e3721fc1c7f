"""`qtool compare A B`: per-tensor error between two checkpoints that share tensor names.

Either side may be anything `detect` recognises: a float checkpoint, a qtool-quantized file
(dequantized on the fly through its sidecar), a sharded set or a model directory (read whole,
by tensor name), a compressed-tensors model directory (dequantized on the fly), so the pairings
float/quantized, quantized/quantized and float/float all work. A is the reference: SQNR is A's
energy over the energy of A - B. Streams tensor by tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from qtool.dtypes import FLOAT_DTYPES
from qtool.errors import InputError
from qtool.formats.base import FloatReader
from qtool.formats.registry import open_reader
from qtool.numerics.metrics import count_nonfinite, error_stats
from qtool.results import POOL_ALL, POOL_QUANTIZED, CompareRow, CompareSummary


def compare_files(a: Path, b: Path, pool: str = POOL_QUANTIZED) -> CompareSummary:
    """One row per tensor name of A, then those only in B; `pool`: what the overall figures
    pool (results.CompareSummary.pooled_over). InputError when no tensor of the two could be
    compared (unrelated files)."""
    if pool not in (POOL_QUANTIZED, POOL_ALL):
        raise ValueError(f"pool must be {POOL_QUANTIZED!r} or {POOL_ALL!r}, not {pool!r}")
    left = open_reader(a)
    try:
        right = open_reader(b)
    except BaseException:
        left.close()
        raise
    try:
        inputs = [str(left.path), str(right.path)]
        rows = _compare_readers(left, right)
        summary = CompareSummary(inputs=inputs, rows=rows, pool=pool)
    finally:
        left.close()
        right.close()
    if not summary.compared:
        raise InputError(a, f"no tensor could be compared with {b}: {_why_none(summary)}")
    return summary


def _why_none(summary: CompareSummary) -> str:
    only_a = sum(r.missing_in == "B" for r in summary.rows)
    only_b = sum(r.missing_in == "A" for r in summary.rows)
    other = len(summary.rows) - only_a - only_b
    if not summary.rows:
        return "neither file holds a tensor"
    return (
        f"{only_a} tensor(s) only in A, {only_b} only in B, {other} with another shape or "
        "dtype kind; are these checkpoints of the same model?"
    )


def _compare_readers(left: FloatReader, right: FloatReader) -> list[CompareRow]:
    """Rows for every tensor of the two, in A's order, then those only in B."""
    in_left, in_right = set(left.names), set(right.names)
    order = left.names + [n for n in right.names if n not in in_left]
    return [_compare_one(left, right, n, in_left, in_right) for n in order]


def open_tensor_source(path: Path, name: str) -> FloatReader:
    """The checkpoint at `path` (a file or a directory, read whole) as float values."""
    return open_reader(path)


def _compare_one(
    left: FloatReader, right: FloatReader, name: str, in_left: set[str], in_right: set[str]
) -> CompareRow:
    sides = _Sides(left, right, name, name in in_left, name in in_right)
    if not (sides.in_a and sides.in_b):
        missing = "B" if sides.in_a else "A"
        return replace(sides.row(f"missing in {missing}", mismatch=True), missing_in=missing)
    if left.shape(name) != right.shape(name):
        detail = f"shape mismatch: {list(left.shape(name))} vs {list(right.shape(name))}"
        return sides.row(detail, mismatch=True)
    da, db = left.dtype(name), right.dtype(name)
    restored = left.quantization(name) is not None or right.quantization(name) is not None
    if not restored and (da in FLOAT_DTYPES) != (db in FLOAT_DTYPES):
        return sides.row(f"dtype mismatch: {da} vs {db}", mismatch=True)
    x, y = left.values(name), right.values(name)  # a quantized side's scales checked here
    if da not in FLOAT_DTYPES:
        same = x.dtype == y.dtype and torch.equal(x, y)
        detail = "identical" if same else "values differ"
        return sides.row(detail, mismatch=not same, compared=True)
    stats = error_stats(x, y)
    if not stats.finite:  # only NaN/Inf inputs get here: finite ones give finite figures
        detail = f"NaN/Inf values: {count_nonfinite(x)} in A, {count_nonfinite(y)} in B"
        return sides.row(detail, mismatch=True, compared=True)
    left.release(name)
    right.release(name)
    row = sides.row(_label(left, right, name), mismatch=False, compared=True)
    return replace(row, errors=stats, restored=_restored(left, right, name))


def _restored(left: FloatReader, right: FloatReader, name: str) -> str | None:
    """The dtype a quantized side was restored to (B's when both are); None for float/float."""
    for side in (right, left):
        if side.quantization(name) is not None:
            return side.dtype(name)
    return None


def _label(left: FloatReader, right: FloatReader, name: str) -> str:
    sides = [
        "dequantized" if s.quantization(name) is not None else s.dtype(name) for s in (left, right)
    ]
    return f"{sides[0]} vs {sides[1]}"


@dataclass(frozen=True)
class _Sides:
    """One tensor name as seen in A and in B."""

    left: FloatReader
    right: FloatReader
    name: str
    in_a: bool
    in_b: bool

    def row(self, detail: str, *, mismatch: bool, compared: bool = False) -> CompareRow:
        """The dtypes are as stored in A and B (I8 for a quantized tensor; the detail says it
        was dequantized)."""
        reader = self.left if self.in_a else self.right
        return CompareRow(
            name=self.name,
            shape=reader.shape(self.name),
            dtype_a=self.left.stored_dtype(self.name) if self.in_a else "-",
            dtype_b=self.right.stored_dtype(self.name) if self.in_b else "-",
            detail=detail,
            bytes_a=self.left.nbytes(self.name) if self.in_a else 0,
            bytes_b=self.right.nbytes(self.name) if self.in_b else 0,
            compared=compared,
            mismatch=mismatch,
        )
