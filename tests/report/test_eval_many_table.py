"""`qtool eval FLOAT Q1 Q2 ...`'s candidate table within the output's width: long QUANT paths
are shortened to their shortest distinct endings and folded (they overflowed every row and the
rule), a hidden column is named (they went silently), and the KL columns say their unit."""

from __future__ import annotations

import pytest

from qtool.eval_results import CausalFigures, Distribution, EvalSummary, TextInfo
from qtool.report.eval_console import print_many, short_paths

DEEP = "/very/long/directory/of/experiments/with/many/levels/2026-12-06/candidates"


def _summary(quant: str, kl: float) -> EvalSummary:
    dist = Distribution(kl, kl / 2, kl * 3, kl * 5, kl * 9, p999=kl * 7)
    causal = CausalFigures(12.5, 13.25, dist, 400, 500, 0.01, 0.002, -0.0004)
    return EvalSummary(("models/float", quant), "qtool reader", "LlamaForCausalLM", "causal-lm",
                       TextInfo("text.txt", 1000, "0" * 64), "FLOAT's", 512, 512, 1, "float32",
                       "cpu", 10, 20, causal, None, None, 1.0, 2.0)  # fmt: skip


@pytest.mark.parametrize("width", [60, 80, 120])
def test_the_candidate_table_never_exceeds_the_width_and_names_what_it_hid(
    width: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", str(width))
    quants = [f"{DEEP}/smollm2-135m-instruct-{q}-with-a-long-name.gguf"
              for q in ("q4_0_imatrix", "q4_k_m_imatrix", "iq4_nl")]  # fmt: skip
    print_many([(_summary(q, 0.01 * (i + 1)), []) for i, q in enumerate(quants)], False, None)
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= width, out
    joined = " ".join(out.split())  # folded lines joined
    assert "nats per token" in joined
    assert DEEP not in out and "distinct ending" in joined  # the shared directory left out
    if width < 120:  # some of median, p99, p99.9, max, ln ratio, Δp hidden: said so
        assert "hidden to fit" in joined and f"{width} columns" in joined, out


def test_short_paths_keep_the_fewest_components_that_tell_them_apart() -> None:
    assert short_paths(["a/q4/model.gguf", "b/q4/model.gguf"]) == [
        "a/q4/model.gguf",
        "b/q4/model.gguf",
    ]
    assert short_paths(["/x/y/a.gguf", "/x/z/b.gguf"]) == ["a.gguf", "b.gguf"]
    assert short_paths(["/x/y/m", "/x/z/m"]) == ["y/m", "z/m"]
    assert short_paths(["m"]) == ["m"]


def test_the_kl_quantiles_in_order_and_dp_in_percentage_points(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One QUANT's report put p99.9 on a line after max, and printed Δp with '%' where
    eval.md says percentage points; the table's Δp column likewise."""
    from qtool.report.eval_console import print_eval

    monkeypatch.setenv("COLUMNS", "120")
    print_eval(_summary("q", 0.01), None, None, "output")
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "KL median" in line)
    assert "KL median, p90, p99, p99.9, max" in row and "0.005, 0.03, 0.05, 0.07, 0.09" in row, out
    assert "p99.9" not in out.replace(row, "")
    dp = next(line for line in out.splitlines() if "Δp" in line)
    assert dp.endswith("percentage points") and "%" not in dp, dp
    print_many([(_summary("q", 0.01), [])], False, None)
    out = capsys.readouterr().out
    assert "Δp (pp)" in out and out.count("%") == 1, out  # top-1's alone
