"""`qtool compare A B`: per-tensor error between two checkpoints that share tensor names.

Either side may be anything `detect` recognises: a float checkpoint, a qtool-quantized file
(dequantized on the fly through its sidecar), a sharded set or a model directory (read whole,
by tensor name), a compressed-tensors model directory (dequantized on the fly), a GGUF file
(dequantized as ggml does), so the pairings float/quantized, quantized/quantized and
float/float all work. A GGUF file against the Hugging Face checkpoint it was converted from is
read under that checkpoint's names and layout (formats/gguf/names.py); a tensor the mapping
cannot place is a mismatch row saying why. A is the reference: SQNR is A's energy over the
energy of A - B. Streams tensor by tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from qtool.dtypes import FLOAT_DTYPES
from qtool.engine.threads import using_threads
from qtool.errors import InputError
from qtool.formats.base import FloatReader
from qtool.formats.detect import Detected, detect
from qtool.formats.registry import entry, matched, open_reader
from qtool.numerics import select
from qtool.numerics.metrics import count_nonfinite, error_stats
from qtool.results import POOL_ALL, POOL_QUANTIZED, CompareRow, CompareSummary, ErrorStats, Progress

CPU = torch.device("cpu")


def compare_files(
    a: Path, b: Path, pool: str = POOL_QUANTIZED, progress: Progress | None = None
) -> CompareSummary:
    """One row per tensor name of A, then those only in B; `pool`: what the overall figures
    pool (results.CompareSummary.pooled_over). InputError when no tensor of the two could be
    compared (unrelated files). A side whose format names tensors its own way (GGUF) against
    one that does not is read under the other's names (registry.matched). `progress` gets the
    bytes of both sides, tensor by tensor."""
    if pool not in (POOL_QUANTIZED, POOL_ALL):
        raise ValueError(f"pool must be {POOL_QUANTIZED!r} or {POOL_ALL!r}, not {pool!r}")
    left, right, unplaced = open_pair(a, b)
    try:
        inputs = [str(left.path), str(right.path)]
        with using_threads(None):  # the idle cores: more threads than that stall each other
            rows = _compare_readers(left, right, unplaced, progress)
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


def open_pair(a: Path, b: Path) -> tuple[FloatReader, FloatReader, dict[str, str]]:
    """A and B as float tensors under one naming (see _matching), and why each name without
    a counterpart has none; the caller closes both."""
    found_a, found_b = detect(a), detect(b)
    left = open_reader(found_a)
    try:
        right = open_reader(found_b)
    except BaseException:
        left.close()
        raise
    try:
        return _matching(left, found_a, right, found_b)
    except BaseException:
        left.close()
        right.close()
        raise


def _matching(
    left: FloatReader, found_a: Detected, right: FloatReader, found_b: Detected
) -> tuple[FloatReader, FloatReader, dict[str, str]]:
    """The two readers under one naming, and why each name without a counterpart has none:
    when they share no tensor name and one side's format names tensors its own way (a GGUF
    file against the Hugging Face checkpoint it was converted from), that side is read under
    the other's names."""
    if set(left.names) & set(right.names):
        return left, right, {}
    own_a, own_b = (entry(f.format).matcher is not None for f in (found_a, found_b))
    if own_b and not own_a:
        found = matched(right, found_b, left.names)
        return left, found.reader, found.unplaced
    if own_a and not own_b:
        found = matched(left, found_a, right.names)
        return found.reader, right, found.unplaced
    return left, right, {}


def _compare_readers(
    left: FloatReader,
    right: FloatReader,
    unplaced: dict[str, str] | None = None,
    progress: Progress | None = None,
) -> list[CompareRow]:
    """Rows for every tensor of the two, in A's order, then those only in B; `unplaced` says
    why a name has no counterpart (a name mapping could not place it)."""
    in_left, in_right = set(left.names), set(right.names)
    order = left.names + [n for n in right.names if n not in in_left]
    why = unplaced or {}
    sizes = {n: _bytes(left, n, in_left) + _bytes(right, n, in_right) for n in order}
    pairs = [n for n in order if n in in_left and n in in_right]
    select.expect(CPU, sum(math.prod(left.shape(n)) for n in pairs), "compare")
    if progress is not None:
        progress.start(sum(sizes.values()))
    rows = []
    for name in order:
        if progress is not None:
            progress.advance(name, 0)
        rows.append(_compare_one(left, right, name, in_left, in_right, why.get(name)))
        if progress is not None:
            progress.advance(name, sizes[name])
    return rows


def _bytes(reader: FloatReader, name: str, names: set[str]) -> int:
    return reader.nbytes(name) if name in names else 0


def _error_stats(x: torch.Tensor, y: torch.Tensor) -> ErrorStats:
    """metrics.error_stats, through the fused kernels when they are loaded (the same figures:
    one pass instead of the float64 copies and folds); the torch path for what they leave."""
    if x.device.type == "cpu" and y.device.type == "cpu" and select.fused_loaded(CPU):
        from qtool.numerics import fused_compare

        stats = fused_compare.error_stats(x, y)
        if stats is not None:
            return stats
    return error_stats(x, y)


def _compare_one(
    left: FloatReader,
    right: FloatReader,
    name: str,
    in_left: set[str],
    in_right: set[str],
    unplaced: str | None = None,
) -> CompareRow:
    sides = _Sides(left, right, name, name in in_left, name in in_right)
    if not (sides.in_a and sides.in_b):
        missing = "B" if sides.in_a else "A"
        detail = f"missing in {missing}" + (f": {unplaced}" if unplaced else "")
        return replace(sides.row(detail, mismatch=True), missing_in=missing)
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
    stats = _error_stats(x, y)
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


def _codes_dtype(reader: FloatReader, name: str) -> str:
    """The dtype a table shows: the codes' own (I4), not the bytes holding them (U8), as
    quantize's table does."""
    codec = reader.quantization(name)
    stored = reader.stored_dtype(name)
    return codec.codes_label(stored) if codec is not None else stored


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
        was dequantized), and as the table shows them (I4 for 4-bit codes stored as U8)."""
        reader = self.left if self.in_a else self.right
        return CompareRow(
            name=self.name,
            shape=reader.shape(self.name),
            dtype_a=self.left.stored_dtype(self.name) if self.in_a else "-",
            dtype_b=self.right.stored_dtype(self.name) if self.in_b else "-",
            codes_a=_codes_dtype(self.left, self.name) if self.in_a else "-",
            codes_b=_codes_dtype(self.right, self.name) if self.in_b else "-",
            detail=detail,
            bytes_a=self.left.nbytes(self.name) if self.in_a else 0,
            bytes_b=self.right.nbytes(self.name) if self.in_b else 0,
            compared=compared,
            mismatch=mismatch,
        )
