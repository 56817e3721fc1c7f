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
from qtool.index import is_sharded, load_index
from qtool.metrics import error_stats
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
    """One row per tensor name of A, then those only in B; sharded sets shard by shard."""
    if is_sharded(a) or is_sharded(b):
        return _compare_sharded(a, b)
    return CompareSummary(inputs=[str(a), str(b)], rows=_compare_pair(a, b, None))


def _compare_pair(a: Path, b: Path, names: set[str] | None) -> list[TensorRow]:
    """Rows for the tensors of two files (all of them, or those in `names`), in A's order."""
    left = FloatSource(a)
    try:
        right = FloatSource(b)
    except BaseException:
        left.close()
        raise
    try:
        order = list(left.entries) + [n for n in right.entries if n not in left.entries]
        return [_compare_one(left, right, n) for n in order if names is None or n in names]
    finally:
        left.close()
        right.close()


def _compare_sharded(a: Path, b: Path) -> CompareSummary:
    """Two sharded sets: each tensor is compared between the shards that hold it, one pair of
    shards open at a time (a name missing on one side is paired with that side's first shard,
    which does not hold it, so the row says where it is missing)."""
    for path, other in ((a, b), (b, a)):
        if not is_sharded(path):
            raise InputError(
                path,
                f"is a single file but {other.name} is sharded; compare a sharded set with a "
                "sharded set, or one shard with one file",
            )
    left, right = load_index(a), load_index(b)
    groups: dict[tuple[str, str], set[str]] = {}
    names = list(left.weight_map) + [n for n in right.weight_map if n not in left.weight_map]
    for name in names:
        key = (
            left.weight_map.get(name, left.shards[0]),
            right.weight_map.get(name, right.shards[0]),
        )
        groups.setdefault(key, set()).add(name)
    rows: list[TensorRow] = []
    for (sa, sb), group in sorted(groups.items()):
        rows += _compare_pair(left.directory / sa, right.directory / sb, group)
    return CompareSummary(inputs=[str(left.index), str(right.index)], rows=rows)


def open_tensor_source(path: Path, name: str) -> FloatSource:
    """The file (a shard, for a sharded set) that holds tensor `name`, as float values."""
    if not is_sharded(path):
        return FloatSource(path)
    sharded = load_index(path)
    return FloatSource(sharded.directory / sharded.weight_map[name])


def _compare_one(left: FloatSource, right: FloatSource, name: str) -> TensorRow:
    ea, eb = left.entries.get(name), right.entries.get(name)
    if ea is None or eb is None:
        present = ea or eb
        assert present is not None
        where = "B" if ea is not None else "A"
        return _row(name, present, ea, eb, left, right, f"missing in {where}", mismatch=True)
    if ea.shape != eb.shape:
        detail = f"shape mismatch: {list(ea.shape)} vs {list(eb.shape)}"
        return _row(name, ea, ea, eb, left, right, detail, mismatch=True)
    da, db = left.dtype(name), right.dtype(name)
    if (da in FLOAT_DTYPES) != (db in FLOAT_DTYPES):
        return _row(name, ea, ea, eb, left, right, f"dtype mismatch: {da} vs {db}", mismatch=True)
    x, y = left.values(name), right.values(name)
    if da not in FLOAT_DTYPES:
        same = x.dtype == y.dtype and torch.equal(x, y)
        detail = "identical" if same else "values differ"
        return _row(name, ea, ea, eb, left, right, detail, mismatch=not same)
    stats = error_stats(x, y) if ea.numel else None
    left.release(name)
    right.release(name)
    label = _label(left, right, name)
    return replace(_row(name, ea, ea, eb, left, right, label, mismatch=False), errors=stats)


def _label(left: FloatSource, right: FloatSource, name: str) -> str:
    sides = ["dequantized" if name in s.quantized else s.dtype(name) for s in (left, right)]
    return f"{sides[0]} vs {sides[1]}"


def _row(
    name: str,
    entry: TensorEntry,
    ea: TensorEntry | None,
    eb: TensorEntry | None,
    left: FloatSource,
    right: FloatSource,
    detail: str,
    *,
    mismatch: bool,
) -> TensorRow:
    return TensorRow(
        name=name,
        shape=entry.shape,
        dtype=left.dtype(name) if ea else "-",
        out_dtype=right.dtype(name) if eb else "-",
        quantized=not mismatch,
        detail=detail,
        bytes_in=ea.nbytes if ea else 0,
        bytes_out=eb.nbytes if eb else 0,
        mismatch=mismatch,
    )
