"""An imatrix entry that gives a quantized tensor no weight (sums all 0 over counted rows, or
so small that the float32 mean underflows; one expert's matrix so) would have ggml's
quantizers round the tensor to zeros and its weighted error read as exact: the run refuses it
naming the file and the tensor. A weighted SQNR over values the weights give no energy is
undefined: NaN, null in the JSON, "n/a" in the table, never "exact"."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from qtool.formats.imatrix import write_imatrix
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats
from qtool.report.console import _weighted_cell
from qtool.report.json import _wsqnr
from qtool.results import WeightedError
from tests.conftest import SAMPLES, Invoke

TINY_LM = SAMPLES / "tiny-lm"
Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"


def _imatrix(path: Path, sums: np.ndarray) -> Path:
    entries = {
        K: MatrixStats(np.ones((1, 64), np.float32), np.array([512], np.int64)),
        Q: MatrixStats(sums.reshape(1, 64).astype(np.float32), np.array([512], np.int64)),
    }
    write_imatrix(path, ImportanceMatrix(entries, 512, 1, ("c.txt",)))
    return path


@pytest.mark.parametrize(
    "sums",
    [np.zeros(64), np.full(64, 1e-45)],  # 1e-45 / 512 underflows float32
    ids=["zero", "underflow"],
)
def test_an_entry_weighing_its_tensor_zero_is_refused(
    tmp_path: Path, invoke: Invoke, sums: np.ndarray
) -> None:
    imatrix = _imatrix(tmp_path / "z.imatrix.gguf", sums)
    code, out, err = invoke(
        "quantize", str(TINY_LM), "--dtype", "int4", "--range", "mse",
        "--imatrix", str(imatrix), "-o", str(tmp_path / "q"),
    )  # fmt: skip
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"qtool: error: {imatrix}: tensor {Q!r}: "), err
    assert "llama-imatrix or qtool calibrate" in err, err
    assert not (tmp_path / "q").exists()


def test_one_weighted_column_is_enough(tmp_path: Path, invoke: Invoke) -> None:
    imatrix = _imatrix(tmp_path / "one.imatrix.gguf", np.eye(64)[3])
    code, _, err = invoke(
        "quantize", str(TINY_LM), "--dtype", "int4", "--range", "mse",
        "--imatrix", str(imatrix), "-o", str(tmp_path / "q"),
    )  # fmt: skip
    assert code == 0, err


@pytest.mark.parametrize("error", [0.0, 1.0])
def test_a_weighted_sqnr_without_signal_is_undefined(error: float) -> None:
    weighted = WeightedError(0.0, error)
    assert math.isnan(weighted.sqnr_db)
    assert _wsqnr(weighted) is None
    assert _weighted_cell(type("Row", (), {"weighted": weighted})())[0] == "n/a"
    assert _wsqnr(WeightedError(1.0, 0.0)) == "Infinity"  # a real exact stays exact
