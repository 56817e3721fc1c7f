"""numerics/imatrix.py: the statistics as values. Merging slices equals one pass over the whole
(checked against sums of squares computed by hand from the rows), llama.cpp's merge rules
(counts added per matrix, a single count spread, float32 sums, chunk_count from the largest
count, datasets in order), h = sums / count with llama-quantize's 1.0 for empty matrices, and
every kind of array llama.cpp could not have collected refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats, merge


def stats_of(rows: np.ndarray) -> MatrixStats:
    """By hand: one matrix, sum of x_j^2 over the rows (float64, then float32) and the count."""
    sums = (rows.astype(np.float64) ** 2).sum(axis=0, keepdims=True).astype(np.float32)
    return MatrixStats(sums, np.array([rows.shape[0]], dtype=np.int64))


def imatrix(
    stats: dict[str, MatrixStats], datasets: tuple[str, ...] = ("a.txt",)
) -> ImportanceMatrix:
    top = max(int(s.counts.max()) for s in stats.values())
    return ImportanceMatrix(stats, 4, top // 4, datasets)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(1, 12),
    st.integers(0, 40),
    st.integers(0, 2**32 - 1),
)
def test_merge_of_slices_is_the_pass_over_the_whole(n: int, k: int, cut: int, seed: int) -> None:
    """Small integer inputs: every sum is exact in float32, so merge must equal the whole."""
    rows = np.random.default_rng(seed).integers(-30, 30, size=(n, k)).astype(np.float32)
    cut = min(cut, n)
    parts = [rows[:cut], rows[cut:]]
    slices = [imatrix({"w": stats_of(p)}, (f"part{i}",)) for i, p in enumerate(parts) if len(p)]
    joined = merge(*slices)
    whole = stats_of(rows)
    np.testing.assert_array_equal(joined.entries["w"].sums, whole.sums)
    np.testing.assert_array_equal(joined.entries["w"].counts, [n])
    assert joined.chunk_count == n // 4
    assert joined.datasets == tuple(f"part{i}" for i, p in enumerate(parts) if len(p))


def test_merge_adds_in_float32_in_file_order() -> None:
    """llama.cpp holds sums in float32 and adds file after file: (a + b) + c, rounded each time."""
    a, b, c = (np.array([[v]], dtype=np.float32) for v in (1.0, 2.0**-24, 2.0**-24))
    one = np.array([1], dtype=np.int64)
    files = [imatrix({"w": MatrixStats(x, one)}) for x in (a, b, c)]
    got = merge(*files).entries["w"].sums
    assert got[0, 0] == np.float32(1.0)  # 1 + 2^-24 rounds to 1, twice; float64 would not
    assert merge(files[1], files[2], files[0]).entries["w"].sums[0, 0] > 1.0


def test_merge_keeps_every_weight_and_counts_per_matrix() -> None:
    x = MatrixStats(np.ones((2, 3), np.float32), np.array([5, 1], np.int64))
    y = MatrixStats(np.full((2, 3), 2, np.float32), np.array([1, 7], np.int64))
    only = MatrixStats(np.ones((1, 3), np.float32), np.array([3], np.int64))
    out = merge(imatrix({"moe": x}), imatrix({"moe": y, "other": only}))
    assert sorted(out.entries) == ["moe", "other"]
    np.testing.assert_array_equal(out.entries["moe"].counts, [6, 8])
    np.testing.assert_array_equal(out.entries["moe"].sums, np.full((2, 3), 3, np.float32))
    assert out.chunk_count == 8 // 4  # the largest count // chunk_size, as llama-imatrix


@pytest.mark.parametrize("single_first", [True, False], ids=["dat-first", "dat-second"])
def test_a_single_count_spreads_over_the_matrices(single_first: bool) -> None:
    """A legacy .dat has one count per weight (n_mat unknown): it spreads over the other side's
    matrices, in either order (llama.cpp accepts only the .dat first)."""
    dat = MatrixStats(np.arange(6, dtype=np.float32)[None], np.array([10], np.int64))
    moe = MatrixStats(np.ones((3, 2), np.float32), np.array([1, 2, 3], np.int64))
    got = dat.merged(moe) if single_first else moe.merged(dat)
    np.testing.assert_array_equal(got.counts, [11, 12, 13])
    np.testing.assert_array_equal(got.sums, np.arange(6, dtype=np.float32).reshape(3, 2) + 1)


@pytest.mark.parametrize(
    ("a", "b"),
    [((1, 4), (1, 6)), ((2, 3), (3, 2)), ((2, 6), (3, 4))],
    ids=["K-differs", "n_mat-both-above-1", "same-size-other-split"],
)
def test_shapes_that_cannot_be_added_are_refused(a: tuple[int, int], b: tuple[int, int]) -> None:
    def make(shape: tuple[int, int]) -> ImportanceMatrix:
        counts = np.ones(shape[0], np.int64)
        return imatrix({"blk.0.ffn_up.weight": MatrixStats(np.ones(shape, np.float32), counts)})

    with pytest.raises(ValueError, match=r"'blk.0.ffn_up.weight': \[.*cannot be added"):
        merge(make(a), make(b))


def test_chunk_sizes_must_agree() -> None:
    s = MatrixStats(np.ones((1, 2), np.float32), np.array([8], np.int64))
    with pytest.raises(ValueError, match="chunk sizes differ"):
        merge(ImportanceMatrix({"w": s}, 4, 2), ImportanceMatrix({"w": s}, 8, 1))


def test_in_sum_is_added_when_both_have_it() -> None:
    def make(in_sum: bool) -> MatrixStats:
        mean = np.full((1, 2), -1.5, np.float32) if in_sum else None
        return MatrixStats(np.ones((1, 2), np.float32), np.array([2], np.int64), mean)

    assert make(True).merged(make(True)).in_sum is not None
    np.testing.assert_array_equal(make(True).merged(make(True)).in_sum, [[-3.0, -3.0]])
    assert make(True).merged(make(False)).in_sum is None


def test_overflow_in_a_merge_is_refused() -> None:
    big = MatrixStats(np.full((1, 1), 3e38, np.float32), np.array([1], np.int64))
    with pytest.raises(ValueError, match="negative, NaN or infinite"):
        big.merged(big)


def test_mean_squares() -> None:
    ok = MatrixStats(np.array([[2, 4], [0, 0]], np.float32), np.array([2, 0], np.int64))
    h = ok.mean_squares()
    assert h.dtype == np.float32
    np.testing.assert_array_equal(h, [[1, 2], [1, 1]])  # no rows: llama-quantize's 1.0


@pytest.mark.parametrize(
    ("sums", "counts", "match"),
    [
        (np.ones(3, np.float32), np.ones(1, np.int64), "2-D float32"),
        (np.ones((1, 3), np.float64), np.ones(1, np.int64), "2-D float32"),
        (np.ones((1, 0), np.float32), np.ones(1, np.int64), "empty"),
        (np.ones((2, 3), np.float32), np.ones(3, np.int64), "3 counts for 2 matrices"),
        (np.ones((1, 3), np.float32), np.ones(1, np.float32), "int64"),
        (np.ones((1, 3), np.float32), -np.ones(1, np.int64), "negative or over"),
        (np.ones((1, 3), np.float32), np.array([2**60], np.int64), "negative or over"),
        (-np.ones((1, 3), np.float32), np.ones(1, np.int64), "3 sums are negative"),
        (np.array([[1, np.nan]], np.float32), np.ones(1, np.int64), "column 1: nan"),
        (np.array([[1, np.inf]], np.float32), np.ones(1, np.int64), "NaN or infinite"),
        (np.ones((2, 2), np.float32), np.array([1, 0], np.int64), "matrix 1 has non-zero"),
    ],
    ids=[
        "1-D",
        "float64",
        "empty",
        "n_mat-mismatch",
        "float-counts",
        "negative-count",
        "huge-count",
        "negative-sums",
        "nan",
        "inf",
        "sums-without-rows",
    ],  # fmt: skip
)
def test_impossible_statistics_are_refused(
    sums: np.ndarray, counts: np.ndarray, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        MatrixStats(sums, counts)


def test_in_sum_is_checked() -> None:
    sums, counts = np.ones((1, 2), np.float32), np.ones(1, np.int64)
    with pytest.raises(ValueError, match="in_sum of shape"):
        MatrixStats(sums, counts, np.ones((1, 3), np.float32))
    with pytest.raises(ValueError, match="in_sum are NaN"):
        MatrixStats(sums, counts, np.array([[0, np.nan]], np.float32))
    MatrixStats(sums, counts, -np.ones((1, 2), np.float32))  # sums of x may be negative


def test_the_arrays_are_read_only() -> None:
    s = MatrixStats(np.ones((1, 2), np.float32), np.ones(1, np.int64))
    with pytest.raises(ValueError, match="read-only"):
        s.sums[0, 0] = 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"entries": {}}, "no statistics"),
        ({"entries": {"": None}}, "empty or holds a NUL"),
        ({"chunk_size": 0}, "chunk size 0"),
        ({"chunk_count": 2**32}, "chunk count"),
        ({"datasets": (1,)}, "dataset name"),
    ],
    ids=["empty", "empty-name", "chunk-size", "chunk-count", "dataset"],
)
def test_the_matrix_is_checked(kwargs: dict[str, object], match: str) -> None:
    s = MatrixStats(np.ones((1, 2), np.float32), np.ones(1, np.int64))
    args: dict[str, object] = {"entries": {"w": s}, "chunk_size": 4, "chunk_count": 0}
    with pytest.raises(ValueError, match=match):
        ImportanceMatrix(**(args | kwargs))  # type: ignore[arg-type]


def test_renamed() -> None:
    s = MatrixStats(np.ones((1, 2), np.float32), np.ones(1, np.int64))
    m = ImportanceMatrix({"a": s, "b": s}, 4, 0, ("t",))
    out = m.renamed({"a": "x"})
    assert list(out.entries) == ["x", "b"] and out.datasets == ("t",)
    with pytest.raises(ValueError, match="both be named 'b'"):
        m.renamed({"a": "b"})
