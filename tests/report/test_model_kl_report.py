"""The model-level figures of `quantize --method` in the console: the KL in nats/token to 4
significant digits, the positions counted and the texts named; a model-level gate
(--max-kl-ratio) says its ratios when it passes, names the held-out windows when it fails, and
draws no per-tensor gate column (a per-tensor bound still does)."""

from __future__ import annotations

import pytest

from qtool.calibration import Role, TextUse
from qtool.gates import Gate, evaluate
from qtool.report import console
from qtool.results import ErrorStats, ModelKL, QuantizeRow, QuantizeSummary
from qtool.spec import QSpec

FIGURES = (ModelKL("held-out", 2040, 0.00069951, 0.0041234),
           ModelKL("check text", 510, 0.0123456, 0.0234567))  # fmt: skip
TEXTS = (TextUse("calib.txt", None, 4096, Role.CALIBRATION),
         TextUse("GPL-3", None, 512, Role.CHECK))  # fmt: skip


def _summary(figures: tuple[ModelKL, ...] = FIGURES) -> QuantizeSummary:
    stats = ErrorStats(4096, 1.0, 0.01, 0.001)
    rows = [QuantizeRow(f"model.layers.{i}.mlp.up_proj.weight", (64, 64), "BF16", "I8", True,
                        "sym int8 axis 0", 8192, 4096, stats) for i in range(2)]  # fmt: skip
    return QuantizeSummary(inputs=["m"], outputs=["q"], rows=rows, spec=QSpec(), device="cpu",
                           texts=TEXTS, model_kl=figures)  # fmt: skip


def _printed(
    summary: QuantizeSummary, gate: Gate, capsys: pytest.CaptureFixture[str]
) -> tuple[str, list[str]]:
    result = evaluate(gate, summary.rows, summary.overall, [], summary.model_kl)
    console.print_quantize(summary, None, result)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if " tensor " in line)
    return " ".join(out.split()), header.split()


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")


def test_the_model_kl_names_its_units_positions_and_texts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text, _ = _printed(_summary(), Gate(), capsys)
    assert (
        "model KL (nats/token): held-out windows of calib.txt, 2040 positions: 0.0006995 "
        "(rounding 0.004123); check text GPL-3, 510 positions: 0.01235 (rounding 0.02346)"
    ) in text


def test_a_model_level_gate_says_its_ratios_and_draws_no_tensor_column(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text, header = _printed(_summary(), Gate(max_kl_ratio=1.0), capsys)
    assert "gate" not in header
    assert (
        "gate: passed (model KL 0.17x on the held-out windows, 0.526x on the check text "
        "round to nearest's; bound 1x)" in text
    )
    text, header = _printed(_summary(), Gate(max_kl_ratio=0.5), capsys)
    assert "gate" not in header
    assert "model KL on the held-out windows" not in text  # 0.17x passes 0.5x
    assert "model KL on the check text 0.01235 nats/token is 0.526x" in text
    losing = (ModelKL("held-out", 2040, 0.002, 0.001),)
    text, _ = _printed(_summary(losing), Gate(max_kl_ratio=1.0), capsys)
    assert "gate: FAILED (model KL on the held-out windows 0.002 nats/token is 2x" in text


def test_a_per_tensor_bound_keeps_its_column(capsys: pytest.CaptureFixture[str]) -> None:
    _, header = _printed(_summary(), Gate(min_sqnr=10.0, max_kl_ratio=1.0), capsys)
    assert "gate" in header
