"""compare: NaN/Inf, infinite SQNRs, unrelated files, and what the JSON says about each row."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import Invoke

GATES = ["--min-sqnr", "10", "--max-mse", "0.1", "--min-overall-sqnr", "10"]


def _pair(tmp_path: Path, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    return ["compare", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]


def _bad(value: float) -> torch.Tensor:
    t = torch.ones(4, 4)
    t[0, :3] = value
    return t


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("side", ["B", "A"])
def test_nonfinite_values_are_a_mismatch_that_fails_every_gate(
    invoke: Invoke, tmp_path: Path, bad: float, side: str
) -> None:
    ones, other = {"w": torch.ones(4, 4), "k": torch.ones(3)}, {"w": _bad(bad), "k": torch.ones(3)}
    args = _pair(tmp_path, *((ones, other) if side == "B" else (other, ones)))
    code, stdout, stderr = invoke(*args, *GATES, "--json")
    assert code == 3, stderr
    doc = json.loads(stdout)  # valid JSON: no NaN/Infinity literals
    row = next(t for t in doc["tensors"] if t["name"] == "w")
    counts = "0 in A, 3 in B" if side == "B" else "3 in A, 0 in B"
    assert row["mismatch"] and row["compared"] and row["mse"] is None
    assert row["detail"] == f"NaN/Inf values: {counts}"
    assert doc["gate"]["passed"] is False
    assert {(v["tensor"], v["metric"]) for v in doc["gate"]["violations"]} == {("w", "mismatch")}
    code, stdout, _ = invoke(*args, *GATES)
    assert code == 3 and "gate: FAILED" in stdout and "passed" not in stdout


def test_sqnr_plus_and_minus_infinity_have_distinct_json_and_bars(
    invoke: Invoke, tmp_path: Path
) -> None:
    a = {"exact": torch.ones(2, 2), "lost": torch.zeros(2, 2), "fine": torch.ones(2, 2)}
    b = {"exact": torch.ones(2, 2), "lost": torch.ones(2, 2), "fine": torch.ones(2, 2) * 1.01}
    args = _pair(tmp_path, a, b)
    code, stdout, _ = invoke(*args, "--min-sqnr", "20", "--json")
    assert code == 3
    doc = json.loads(stdout)
    rows = {t["name"]: t for t in doc["tensors"]}
    assert rows["exact"]["sqnr_db"] == "Infinity" and rows["lost"]["sqnr_db"] == "-Infinity"
    assert isinstance(rows["fine"]["sqnr_db"], float)
    assert float(rows["lost"]["sqnr_db"]) == -math.inf  # Python reads the strings back
    (violation,) = doc["gate"]["violations"]
    assert violation["tensor"] == "lost" and violation["value"] == "-Infinity"
    assert "below 20.00 dB" in violation["detail"] and "-inf" in violation["detail"]
    _, table, _ = invoke(*args)
    lines = {line.split()[0]: line.rstrip() for line in table.splitlines() if line[:1] == " "}
    assert lines["exact"].endswith("exact   █")
    assert lines["lost"].endswith("-inf")  # an empty bar
    assert "█" not in lines["lost"] and "▁" not in lines["lost"]


def test_unrelated_files_compare_nothing_and_exit_1(invoke: Invoke, tmp_path: Path) -> None:
    args = _pair(tmp_path, {"a": torch.ones(2), "s": torch.ones(2, 2)},
                 {"b": torch.ones(2), "s": torch.ones(3, 2)})  # fmt: skip
    code, stdout, stderr = invoke(*args, "--json")
    assert code == 1 and stdout == ""
    error = json.loads(stderr)["error"]
    assert "no tensor could be compared" in error["message"]
    assert "1 tensor(s) only in A, 1 only in B, 1 with another shape" in error["message"]
    code, _, stderr = invoke(*args)
    assert code == 1 and stderr.count("\n") == 1 and "same model" in stderr


def test_a_row_says_which_side_lacks_its_tensor(tmp_path: Path) -> None:
    """The side a tensor is missing from is a field of its row, not a reading of its text."""
    from qtool import api

    _pair(tmp_path, {"a": torch.ones(2), "s": torch.ones(2, 2)},
          {"b": torch.ones(2), "s": torch.ones(2, 2)})  # fmt: skip
    summary = api.compare(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    missing = {r.name: r.missing_in for r in summary.rows}
    assert missing == {"a": "B", "s": None, "b": "A"}
    assert [r.name for r in summary.mismatches] == ["a", "b"]


def test_integer_tensors_compared_exactly_count_as_compared(invoke: Invoke, tmp_path: Path) -> None:
    ids = torch.arange(6).reshape(2, 3)
    args = _pair(tmp_path, {"ids": ids, "n": torch.tensor(3)}, {"ids": ids, "n": torch.tensor(4)})
    code, stdout, _ = invoke(*args, "--json")
    assert code == 0
    doc = json.loads(stdout)
    rows = {t["name"]: t for t in doc["tensors"]}
    assert rows["ids"]["compared"] and not rows["ids"]["mismatch"]
    assert (
        rows["n"]["compared"] and rows["n"]["mismatch"] and rows["n"]["detail"] == "values differ"
    )
    assert doc["totals"]["compared"] == 2 and doc["totals"]["mismatches"] == 1


def test_bf16_extremes_compare_with_honest_figures(invoke: Invoke, tmp_path: Path) -> None:
    big = torch.finfo(torch.bfloat16).max
    w = torch.tensor([[big, -big, 1.0], [2.0, big, -3.0]], dtype=torch.bfloat16)
    save_file({"w": w}, tmp_path / "m.safetensors")
    assert invoke("quantize", str(tmp_path / "m.safetensors"))[0] == 0
    args = ["compare", str(tmp_path / "m.safetensors"), str(tmp_path / "m.int8.safetensors")]
    code, stdout, _ = invoke(*args, "--json")
    (row,) = json.loads(stdout)["tensors"]
    assert code == 0 and row["dtype_a"] == "BF16" and row["dtype_b"] == "I8"
    assert isinstance(row["sqnr_db"], float) and row["sqnr_db"] > 30
    # Beside 3.4e38 in its channel, -3.0 rounds to code 0: a real error of 3, so SQNR is finite
    # (float32 sums made the signal infinite and the row "exact").
    assert row["max_abs_error"] == 3.0 and row["mse"] == pytest.approx((1 + 4 + 9) / 6)
    w2 = w.clone()
    w2[0, 0] = -big
    save_file({"w": w2}, tmp_path / "n.safetensors")
    code, stdout, _ = invoke("compare", str(tmp_path / "m.safetensors"),
                             str(tmp_path / "n.safetensors"), "--json")  # fmt: skip
    (row,) = json.loads(stdout)["tensors"]
    assert code == 0 and row["max_abs_error"] == pytest.approx(2 * float(big))
    assert isinstance(row["mse"], float) and isinstance(row["sqnr_db"], float)
