"""Importance matrices (llama.cpp's imatrix statistics) as values: merge, means, renames. No I/O.

For a Linear with K input columns fed n token rows x: counts = n and sums[j] = sum x_j^2, so
h_j = E[x_j^2] = sums[j] / n is the weight llama.cpp's quantizers give column j. A 3-D weight
(stacked MoE experts) has one row of sums and one count per matrix: sums [n_mat, K] float32,
counts [n_mat] int64. Runs over slices of a text merge into the run over the whole text by
adding sums and counts (llama-imatrix --in-file A --in-file B, in float32 as it adds).

    h = stats.mean_squares()                      # [n_mat, K] float32
    joined = merge(a, b)                          # ImportanceMatrix
    hf = imatrix.renamed({"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight"})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

MAX_COUNT = 1 << 53  # rows per matrix: exact in float64, far beyond any calibration run
MAX_CHUNK_SIZE = (1 << 31) - 1  # llama.cpp holds it in an int32
MAX_CHUNK_COUNT = (1 << 32) - 1  # written as a UINT32


@dataclass(frozen=True, eq=False)
class MatrixStats:
    """One weight's statistics: `sums` [n_mat, K] float32 (sum of x_j^2), `counts` [n_mat]
    int64 (rows), and `in_sum` [n_mat, K] float32 (sum of x_j) where newer llama-imatrix
    versions record it, else None. Arrays are not copied; they are held read-only views.
    ValueError for anything llama.cpp could not have collected."""

    sums: np.ndarray
    counts: np.ndarray
    in_sum: np.ndarray | None = None

    def __post_init__(self) -> None:
        problem = _problem(self.sums, self.counts, self.in_sum)
        if problem is not None:
            raise ValueError(problem)
        object.__setattr__(self, "sums", _readonly(self.sums))
        object.__setattr__(self, "counts", _readonly(self.counts))
        if self.in_sum is not None:
            object.__setattr__(self, "in_sum", _readonly(self.in_sum))

    @property
    def n_mat(self) -> int:
        return int(self.sums.shape[0])

    @property
    def k(self) -> int:
        """Input columns per matrix (in_features of the Linear)."""
        return int(self.sums.shape[1])

    def mean_squares(self) -> np.ndarray:
        """h = sums / count per matrix, [n_mat, K] float32, divided in float32 as
        llama-quantize does; a matrix with no rows gets 1.0 everywhere (llama-quantize's
        choice for an expert the calibration text never routed to)."""
        counts = self.counts.astype(np.float32)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            h = self.sums / counts
        return np.where(counts > 0, h, np.float32(1.0)).astype(np.float32)

    def merged(self, other: MatrixStats) -> MatrixStats:
        """The statistics of both runs: sums and counts added. A single-count side (a legacy
        .dat holds no matrix count) is spread over the other side's matrices when the sizes
        agree; in_sum is kept only when both sides have it. ValueError if the shapes disagree."""
        a, b = self, other
        if a.sums.size != b.sums.size:
            raise ValueError(f"{_shape(a)} sums cannot be added to {_shape(b)} sums")
        if a.n_mat != b.n_mat:
            if a.n_mat != 1 and b.n_mat != 1:
                raise ValueError(f"{_shape(a)} sums cannot be added to {_shape(b)} sums")
            a, b = (a._spread(b.n_mat), b) if a.n_mat == 1 else (a, b._spread(a.n_mat))
        in_sum = None if a.in_sum is None or b.in_sum is None else a.in_sum + b.in_sum
        with np.errstate(over="ignore"):
            return MatrixStats(a.sums + b.sums, a.counts + b.counts, in_sum)

    def _spread(self, n_mat: int) -> MatrixStats:
        """One matrix of K = n_mat x k columns as n_mat matrices, each with the one count."""
        k = self.sums.size // n_mat
        in_sum = None if self.in_sum is None else self.in_sum.reshape(n_mat, k)
        return MatrixStats(self.sums.reshape(n_mat, k), np.repeat(self.counts, n_mat), in_sum)


@dataclass(frozen=True, eq=False)
class ImportanceMatrix:
    """Statistics per weight name, with how they were gathered: `chunk_size` tokens per chunk,
    `chunk_count` chunks, and the `datasets` (names of the texts) in the order they were added."""

    entries: Mapping[str, MatrixStats]
    chunk_size: int
    chunk_count: int
    datasets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("holds no statistics")
        if any(not isinstance(n, str) or not n or "\0" in n for n in self.entries):
            raise ValueError("a weight name is empty or holds a NUL byte")
        if not 1 <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk size {self.chunk_size} is not in 1..{MAX_CHUNK_SIZE}")
        if not 0 <= self.chunk_count <= MAX_CHUNK_COUNT:
            raise ValueError(f"chunk count {self.chunk_count} is not in 0..{MAX_CHUNK_COUNT}")
        if any(not isinstance(d, str) for d in self.datasets):
            raise ValueError("a dataset name is not a string")
        object.__setattr__(self, "entries", dict(self.entries))

    def renamed(self, names: Mapping[str, str]) -> ImportanceMatrix:
        """The same statistics with each entry in `names` under its new name (the others keep
        theirs); ValueError if two entries would share a name."""
        out: dict[str, MatrixStats] = {}
        for name, stats in self.entries.items():
            new = names.get(name, name)
            if new in out:
                raise ValueError(f"two entries would both be named {new!r}")
            out[new] = stats
        return ImportanceMatrix(out, self.chunk_size, self.chunk_count, self.datasets)


def merge(first: ImportanceMatrix, *others: ImportanceMatrix) -> ImportanceMatrix:
    """What llama-imatrix --in-file writes for these files in this order: every weight of any
    of them, sums and counts added (MatrixStats.merged), the datasets listed in order, and
    chunk_count = the largest count // chunk_size. ValueError naming the weight whose shapes
    disagree, or if the chunk sizes differ (their chunk counts would mean nothing)."""
    entries = dict(first.entries)
    for other in others:
        if other.chunk_size != first.chunk_size:
            raise ValueError(f"chunk sizes differ ({first.chunk_size} and {other.chunk_size})")
        for name, stats in other.entries.items():
            try:
                entries[name] = entries[name].merged(stats) if name in entries else stats
            except ValueError as err:
                raise ValueError(f"{name!r}: {err}") from None
    top = max(int(s.counts.max()) for s in entries.values())
    datasets = first.datasets + tuple(d for o in others for d in o.datasets)
    chunk_count = min(top // first.chunk_size, MAX_CHUNK_COUNT)
    return ImportanceMatrix(entries, first.chunk_size, chunk_count, datasets)


def _problem(sums: np.ndarray, counts: np.ndarray, in_sum: np.ndarray | None) -> str | None:
    """What is wrong with these arrays as one weight's statistics, or None."""
    if not isinstance(sums, np.ndarray) or sums.dtype != np.float32 or sums.ndim != 2:
        return "sums must be a 2-D float32 array [n_mat, K]"
    if sums.shape[0] < 1 or sums.shape[1] < 1:
        return f"sums of shape {list(sums.shape)} are empty"
    if not isinstance(counts, np.ndarray) or counts.dtype != np.int64:
        return "counts must be an int64 array"
    if counts.shape != sums.shape[:1]:
        return f"{counts.size} counts for {sums.shape[0]} matrices of sums"
    if counts.min() < 0 or counts.max() > MAX_COUNT:
        return f"a count is negative or over {MAX_COUNT} rows"
    problem = _values(sums, "sums") or _empty_rows(sums, counts)
    if problem is None and in_sum is not None:
        if not isinstance(in_sum, np.ndarray) or in_sum.dtype != np.float32:
            return "in_sum must be a float32 array"
        if in_sum.shape != sums.shape:
            return f"in_sum of shape {list(in_sum.shape)}, sums {list(sums.shape)}"
        problem = _values(in_sum, "in_sum", signed=True)
    return problem


def _values(x: np.ndarray, what: str, signed: bool = False) -> str | None:
    bad = ~np.isfinite(x) if signed else ~(np.isfinite(x) & (x >= 0))
    if not bad.any():
        return None
    m, j = (int(i) for i in np.unravel_index(int(np.argmax(bad)), x.shape))
    kind = "NaN or infinite" if signed else "negative, NaN or infinite"
    return f"{int(bad.sum())} {what} are {kind} (the first: matrix {m}, column {j}: {x[m, j]})"


def _empty_rows(sums: np.ndarray, counts: np.ndarray) -> str | None:
    held = (counts == 0) & (sums != 0).any(axis=1)
    if not held.any():
        return None
    return f"matrix {int(np.argmax(held))} has non-zero sums over 0 rows"


def _readonly(x: np.ndarray) -> np.ndarray:
    view = np.ascontiguousarray(x).view()
    view.flags.writeable = False
    return view


def _shape(s: MatrixStats) -> str:
    return f"[{s.n_mat}, {s.k}]"


def quant_weights(stats: MatrixStats, k: int, n_mat: int = 1) -> np.ndarray:
    """The `quant_weights` llama-quantize hands ggml's quantizers for a weight of `n_mat`
    matrices (3-D stacked experts; 1 for a Linear) of rows of `k` elements: float32 [n_mat, k],
    row e for every row of matrix e (qtool.numerics.gguf.quantize(rows, qtype,
    quant_weights=qw[e])).

    As tools/quantize and src/llama-quant.cpp compute it: each matrix's sums divided by its own
    count in float32, 1.0 for every column of a matrix no row reached (mean_squares), the whole
    entry taken as one flat vector and cut into n_mat slices of k (llama_tensor_quantize_impl:
    imatrix + (row / nrows_per_expert) * n_per_row), so a legacy .dat entry of one matrix of
    n_mat * k columns serves a 3-D weight too. llama-quantize divides a .dat's values by ncall
    where qtool's reader keeps sums = value * chunk_size over ncall * chunk_size rows: the same
    float32 quotient when chunk_size is a power of two (512, llama-imatrix's default), which
    scales both sides exactly. ValueError when the entry holds other than n_mat * k values
    (llama-quantize refuses that for every tensor but token_embd, which it quantizes without)."""
    if k < 1 or n_mat < 1:
        raise ValueError(f"a weight of {n_mat} matrices of rows of {k} has no columns")
    if stats.sums.size != n_mat * k:
        raise ValueError(
            f"{_shape(stats)} statistics hold {stats.sums.size} values, the weight needs "
            f"{n_mat} x {k} = {n_mat * k}"
        )
    return np.ascontiguousarray(stats.mean_squares().reshape(n_mat, k))
