"""`qtool compare A B`: per-tensor error between two checkpoints that share tensor names.

Either side may be a float checkpoint or a qtool-quantized file, which is dequantized on the fly
through its sidecar, so the pairings float/quantized, quantized/quantized and float/float all
work. A is the reference: SQNR is A's energy over the energy of A - B. Streams tensor by tensor.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from qtool import kernels
from qtool.checkpoint import open_checkpoint
from qtool.errors import InputError
from qtool.metrics import count_nonfinite, error_stats
from qtool.restore import open_quantized
from qtool.sidecar import DIGEST_KEY, scale_name, zero_point_name
from qtool.stformat import FLOAT_DTYPES, TensorEntry
from qtool.summary import CompareSummary, TensorRow


class FloatSource:
    """The tensors of one file as their float values (quantized ones reconstructed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        probe = open_checkpoint(path)
        self._pair = None
        if DIGEST_KEY in (probe.metadata or {}):
            probe.close()
            self._pair = open_quantized(path)
            self._ckpt = self._pair.ckpt
        else:
            self._ckpt = probe
        self.entries = {e.name: e for e in self._ckpt.entries}

    @property
    def quantized(self) -> set[str]:
        return set(self._pair.manifest.tensors) if self._pair else set()

    def dtype(self, name: str) -> str:
        """The logical dtype: a quantized tensor counts as its original dtype."""
        if self._pair and name in self._pair.manifest.tensors:
            return self._pair.manifest.tensors[name].orig_dtype
        return self.entries[name].dtype

    def values(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        if self._pair is None or name not in self._pair.manifest.tensors:
            return self._ckpt.tensor(entry)
        record = self._pair.manifest.tensors[name]
        side = self._pair.sidecar.by_name()
        return kernels.dequantize(
            self._ckpt.tensor(entry),
            self._pair.sidecar.tensor(side[scale_name(name)]),
            self._pair.sidecar.tensor(side[zero_point_name(name)]),
            record.axis,
        )

    def release(self, name: str) -> None:
        self._ckpt.release(self.entries[name])

    def close(self) -> None:
        if self._pair is not None:
            self._pair.close()
        else:
            self._ckpt.close()


def compare_files(a: Path, b: Path) -> CompareSummary:
    """One row per tensor name of A, then those only in B; InputError when no tensor of the
    two could be compared (unrelated files)."""
    for path in (a, b):
        if path.is_dir() or path.name.endswith(".index.json"):
            raise InputError(path, "compare works on single files; compare the shards one by one")
    left = FloatSource(a)
    try:
        right = FloatSource(b)
    except BaseException:
        left.close()
        raise
    try:
        names = list(left.entries) + [n for n in right.entries if n not in left.entries]
        rows = [_compare_one(left, right, name) for name in names]
    finally:
        left.close()
        right.close()
    summary = CompareSummary(inputs=[str(a), str(b)], rows=rows)
    if not summary.compared:
        raise InputError(a, f"no tensor could be compared with {b}: {_why_none(summary)}")
    return summary


def _why_none(summary: CompareSummary) -> str:
    only_a = sum(r.detail == "missing in B" for r in summary.rows)
    only_b = sum(r.detail == "missing in A" for r in summary.rows)
    other = len(summary.rows) - only_a - only_b
    if not summary.rows:
        return "neither file holds a tensor"
    return (
        f"{only_a} tensor(s) only in A, {only_b} only in B, {other} with another shape or "
        "dtype kind; are these checkpoints of the same model?"
    )


def _compare_one(left: FloatSource, right: FloatSource, name: str) -> TensorRow:
    ea, eb = left.entries.get(name), right.entries.get(name)
    if ea is None or eb is None:
        present = ea or eb
        assert present is not None
        where = "B" if ea is not None else "A"
        return _row(name, present, ea, eb, f"missing in {where}", mismatch=True)
    if ea.shape != eb.shape:
        detail = f"shape mismatch: {list(ea.shape)} vs {list(eb.shape)}"
        return _row(name, ea, ea, eb, detail, mismatch=True)
    da, db = left.dtype(name), right.dtype(name)
    if (da in FLOAT_DTYPES) != (db in FLOAT_DTYPES):
        return _row(name, ea, ea, eb, f"dtype mismatch: {da} vs {db}", mismatch=True)
    x, y = left.values(name), right.values(name)
    if da not in FLOAT_DTYPES:
        same = x.dtype == y.dtype and torch.equal(x, y)
        detail = "identical" if same else "values differ"
        return _row(name, ea, ea, eb, detail, mismatch=not same, compared=True)
    stats = error_stats(x, y)
    if not stats.finite:  # only NaN/Inf inputs get here: finite ones give finite figures
        detail = f"NaN/Inf values: {count_nonfinite(x)} in A, {count_nonfinite(y)} in B"
        return _row(name, ea, ea, eb, detail, mismatch=True, compared=True)
    left.release(name)
    right.release(name)
    row = _row(name, ea, ea, eb, _label(left, right, name), mismatch=False, compared=True)
    return replace(row, errors=stats)


def _label(left: FloatSource, right: FloatSource, name: str) -> str:
    sides = ["dequantized" if name in s.quantized else s.dtype(name) for s in (left, right)]
    return f"{sides[0]} vs {sides[1]}"


def _row(
    name: str,
    entry: TensorEntry,
    ea: TensorEntry | None,
    eb: TensorEntry | None,
    detail: str,
    *,
    mismatch: bool,
    compared: bool = False,
) -> TensorRow:
    """dtype / out_dtype are the dtypes stored in A and B (I8 for a quantized tensor; the
    detail says it was dequantized)."""
    return TensorRow(
        name=name,
        shape=entry.shape,
        dtype=ea.dtype if ea else "-",
        out_dtype=eb.dtype if eb else "-",
        quantized=not mismatch,
        detail=detail,
        bytes_in=ea.nbytes if ea else 0,
        bytes_out=eb.nbytes if eb else 0,
        mismatch=mismatch,
        compared=compared,
    )
