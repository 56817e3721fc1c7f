"""Quality gates: a NaN or infinite figure never passes; bounds are checked before any work."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from qtool.gates import Gate, evaluate
from qtool.results import ErrorStats, QuantizeRow
from tests.conftest import Invoke


def _row(name: str, stats: ErrorStats) -> QuantizeRow:
    return QuantizeRow(name, (2,), "F32", "I8", True, "sym int8 tensor", 8, 2, errors=stats)


FIGURES = {
    "nan-error": ErrorStats(4, math.nan, 4.0, 1.0),
    "inf-error": ErrorStats(4, math.inf, 4.0, math.inf),
    "inf-signal": ErrorStats(4, 1e-9, math.inf, 1e-5),
    "nan-max": ErrorStats(4, 1e-9, 4.0, math.nan),
}


@pytest.mark.parametrize("stats", FIGURES.values(), ids=FIGURES.keys())
@pytest.mark.parametrize(
    "gate",
    [Gate(max_mse=1.0), Gate(min_sqnr=10.0), Gate(min_overall_sqnr=10.0)],
    ids=["max-mse", "min-sqnr", "min-overall-sqnr"],
)
def test_nonfinite_figures_never_pass_a_gate(stats: ErrorStats, gate: Gate) -> None:
    result = evaluate(gate, [_row("w", stats)], stats, [])
    assert not result.passed
    assert all(v.detail for v in result.violations)


def test_violations_explain_themselves() -> None:
    row = _row("w", ErrorStats(4, 4e-2, 4.0, 0.2))  # mse 0.01, SQNR 20 dB
    result = evaluate(Gate(max_mse=1e-3, min_sqnr=30, min_overall_sqnr=25), [row], row.errors, [])
    details = {v.metric: v.detail for v in result.violations}
    assert details == {
        "mse": "MSE 0.01 is above 0.001",
        "sqnr_db": "SQNR 20.00 dB is below 30.00 dB",
        "overall_sqnr_db": "pooled SQNR 20.00 dB is below 25.00 dB",
    }
    exact = _row("e", ErrorStats(4, 0.0, 4.0, 0.0))
    assert evaluate(Gate(max_mse=0.0, min_sqnr=300), [exact], exact.errors, []).passed


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "Infinity"])
@pytest.mark.parametrize("option", ["--max-mse", "--min-sqnr", "--min-overall-sqnr"])
@pytest.mark.parametrize("command", ["quantize", "compare"])
def test_nonfinite_bounds_are_usage_errors_before_anything_is_read(
    invoke: Invoke, tmp_path: Path, command: str, option: str, value: str
) -> None:
    missing = [str(tmp_path / "missing.safetensors")] * (2 if command == "compare" else 1)
    code, stdout, stderr = invoke(command, *missing, option, value, "--json")
    assert code == 2 and stdout == ""
    assert option in stderr and "finite" in stderr and "no such file" not in stderr
    assert list(tmp_path.iterdir()) == []


def test_a_negative_mse_bound_is_a_usage_error(invoke: Invoke, tmp_path: Path) -> None:
    code, _, stderr = invoke("quantize", str(tmp_path / "m.safetensors"), "--max-mse", "-1")
    assert code == 2 and "--max-mse" in stderr


@pytest.mark.parametrize("bound", [["--min-sqnr", "30"], ["--max-mse", "1"]], ids=["sqnr", "mse"])
def test_a_gate_on_a_plain_dry_run_is_a_usage_error(
    invoke: Invoke, samples: Path, bound: list[str]
) -> None:
    args = ["quantize", str(samples / "mlp.safetensors"), "--dry-run", *bound]
    code, stdout, stderr = invoke(*args)
    assert code == 2 and stdout == "" and "--estimate" in stderr
    code, stdout, _ = invoke(*args, "--estimate", "--json")
    assert code == 0 and json.loads(stdout)["gate"]["passed"] is True
