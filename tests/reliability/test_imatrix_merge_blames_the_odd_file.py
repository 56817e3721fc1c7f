"""`calibrate --merge A B C`: a file whose entry's shape (or chunk size) disagrees with the files
before it is refused naming that file, the ones it was merged with and what to do; it named A,
the first (good) file, whichever input disagreed, and said 'with the others'."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qtool.formats.imatrix import write_imatrix
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats
from tests.conftest import Invoke


def _imatrix(path: Path, n_mat: int, columns: int, chunk_size: int = 32) -> Path:
    stats = MatrixStats(np.ones((n_mat, columns), np.float32), np.full(n_mat, 64, np.int64))
    write_imatrix(path, ImportanceMatrix({"blk.0.ffn_gate_exps.weight": stats}, chunk_size, 2, ()))
    return path


@pytest.mark.parametrize("odd", ["experts", "columns", "chunk_size"])
@pytest.mark.parametrize("position", [1, 2])
def test_the_file_that_disagrees_is_named(
    tmp_path: Path, invoke: Invoke, odd: str, position: int
) -> None:
    good = [_imatrix(tmp_path / f"g{i}.gguf", 4, 64) for i in range(2)]
    bad = _imatrix(tmp_path / "bad.gguf", 3 if odd == "experts" else 4,
                   16 if odd == "columns" else 64, 64 if odd == "chunk_size" else 32)  # fmt: skip
    inputs = [*good]
    inputs.insert(position, bad)
    out = tmp_path / "out.gguf"
    code, stdout, err = invoke("calibrate", "--merge", *map(str, inputs), "-o", str(out))
    assert code == 1 and stdout == "" and err.count("\n") == 1, err
    assert err.startswith(f"qtool: error: {bad}: cannot be merged with {good[0]}"), err
    assert "merge only files calibrated on the same model" in err, err
    assert not out.exists()
