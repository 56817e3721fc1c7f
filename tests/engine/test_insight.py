"""Quality gates, compare, dry runs, ordering and plots (issue: CI pipelines and insight)."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import Invoke

MLP = "mlp.safetensors"


def _quantized(invoke: Invoke, samples: Path, *extra: str) -> Path:
    out = samples / "q.safetensors"
    code, _, stderr = invoke("quantize", str(samples / MLP), "-o", str(out), *extra)
    assert code == 0, stderr
    return out


# ---- gates ----------------------------------------------------------------------------------


def test_gate_failure_exits_3_writes_outputs_and_lists_violations(
    invoke: Invoke, samples: Path
) -> None:
    out = samples / "q.safetensors"
    args = ["quantize", str(samples / MLP), "-o", str(out), "--per-tensor", "--json"]
    code, stdout, _ = invoke(*args, "--min-sqnr", "40", "--max-mse", "1e-4")
    assert code == 3
    assert out.exists() and (samples / "q.qparams.safetensors").exists()
    gate = json.loads(stdout)["gate"]
    assert gate["passed"] is False
    assert gate["bounds"] == {"max_mse": 1e-4, "min_sqnr_db": 40.0, "min_overall_sqnr_db": None}
    violations = {(v["tensor"], v["metric"]) for v in gate["violations"]}
    assert violations == {("head.weight", "sqnr_db"), ("head.weight", "mse")}


def test_gate_pass_and_overall_bound(invoke: Invoke, samples: Path) -> None:
    args = ["quantize", str(samples / MLP), "-o", str(samples / "q.safetensors"), "--force"]
    code, stdout, _ = invoke(*args, "--min-sqnr", "30")
    assert code == 0 and "gate: passed" in stdout
    code, stdout, _ = invoke(*args, "--min-overall-sqnr", "60")
    assert code == 3 and "gate: FAILED (overall SQNR below 60.0 dB)" in stdout
    assert not [line for line in stdout.splitlines() if line.rstrip().endswith("FAIL")]
    code, stdout, _ = invoke(*args)
    assert code == 0 and "gate:" not in stdout


def test_gate_marks_offending_rows_in_the_table(invoke: Invoke, samples: Path) -> None:
    args = ["quantize", str(samples / MLP), "-o", str(samples / "q.safetensors"), "--per-tensor"]
    code, stdout, _ = invoke(*args, "--min-sqnr", "40")
    assert code == 3
    line = next(line for line in stdout.splitlines() if line.startswith(" head.weight"))
    assert line.rstrip().endswith("FAIL")
    assert "gate: FAILED (1 tensor(s) out of bounds: head.weight)" in stdout


# ---- compare --------------------------------------------------------------------------------


def test_compare_float_vs_quantized(invoke: Invoke, samples: Path) -> None:
    q = _quantized(invoke, samples)
    code, stdout, _ = invoke("compare", str(samples / MLP), str(q), "--json")
    assert code == 0
    doc = json.loads(stdout)
    assert doc["command"] == "compare" and doc["schema_version"] == 2 and doc["ok"] is True
    rows = {t["name"]: t for t in doc["tensors"]}
    assert rows["head.weight"]["detail"] == "F32 vs dequantized"
    assert rows["head.weight"]["dtype_a"] == "F32" and rows["head.weight"]["dtype_b"] == "I8"
    assert rows["head.bias"]["sqnr_db"] == "Infinity" and rows["head.bias"]["mse"] == 0.0
    assert rows["step"]["detail"] == "identical" and rows["step"]["compared"]
    assert doc["totals"]["compared"] == doc["totals"]["tensors"] == 11
    assert doc["totals"]["mismatches"] == 0


def test_compare_agrees_with_quantize_figures(invoke: Invoke, samples: Path) -> None:
    q = samples / "q.safetensors"
    _, qout, _ = invoke("quantize", str(samples / MLP), "-o", str(q), "--json")
    _, cout, _ = invoke("compare", str(samples / MLP), str(q), "--json")
    quantized = {t["name"]: t for t in json.loads(qout)["tensors"] if t["quantized"]}
    compared = {t["name"]: t for t in json.loads(cout)["tensors"]}
    for name, t in quantized.items():
        assert compared[name]["mse"] == pytest.approx(t["mse"], rel=1e-4)
        assert compared[name]["sqnr_db"] == pytest.approx(t["sqnr_db"], abs=1e-3)


def test_compare_two_quantized_and_two_float_files(invoke: Invoke, samples: Path) -> None:
    a = _quantized(invoke, samples)
    b = samples / "b.safetensors"
    invoke("quantize", str(samples / MLP), "-o", str(b), "--scheme", "asym")
    code, stdout, _ = invoke("compare", str(a), str(b), "--json")
    assert code == 0
    detail = {t["name"]: t["detail"] for t in json.loads(stdout)["tensors"]}
    assert detail["head.weight"] == "dequantized vs dequantized"
    code, stdout, _ = invoke("compare", str(samples / MLP), str(samples / MLP), "--json")
    doc = json.loads(stdout)
    assert code == 0 and doc["totals"]["sqnr_db"] == "Infinity" and doc["totals"]["mse"] == 0.0


def test_compare_reports_missing_and_mismatched_tensors(invoke: Invoke, tmp_path: Path) -> None:
    save_file({"w": torch.ones(2, 2), "only_a": torch.ones(3), "s": torch.ones(4, 2)},
              tmp_path / "a.safetensors")  # fmt: skip
    save_file({"w": torch.ones(2, 2), "only_b": torch.ones(3), "s": torch.ones(2, 4)},
              tmp_path / "b.safetensors")  # fmt: skip
    args = ["compare", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    code, stdout, _ = invoke(*args, "--json")
    assert code == 0  # no gate: mismatches are reported, not fatal
    rows = {t["name"]: t for t in json.loads(stdout)["tensors"]}
    assert rows["only_a"]["detail"] == "missing in B" and rows["only_a"]["mismatch"]
    assert rows["only_b"]["detail"] == "missing in A"
    assert rows["s"]["detail"] == "shape mismatch: [4, 2] vs [2, 4]"
    code, stdout, _ = invoke(*args, "--min-sqnr", "10", "--json")
    assert code == 3
    assert {v["metric"] for v in json.loads(stdout)["gate"]["violations"]} == {"mismatch"}


# ---- dry run, ordering -----------------------------------------------------------------------


def test_dry_run_reads_no_tensor_data_and_writes_nothing(invoke: Invoke, samples: Path) -> None:
    src = samples / MLP
    # Corrupt every data byte: a dry run must not notice, because it never reads them.
    blob = bytearray(src.read_bytes())
    start = 8 + struct.unpack("<Q", blob[:8])[0]
    blob[start:] = b"\xff" * (len(blob) - start)  # NaN everywhere
    src.write_bytes(bytes(blob))
    before = sorted(p.name for p in samples.iterdir())
    code, stdout, _ = invoke("quantize", str(src), "--dry-run", "--json")
    assert code == 0
    doc = json.loads(stdout)
    assert doc["dry_run"] and doc["totals"]["quantized"] == 4 and doc["device"] == "none"
    assert doc["outputs"][0].endswith("mlp.int8.safetensors")
    assert sorted(p.name for p in samples.iterdir()) == before
    code, _, stderr = invoke("quantize", str(src), "--dry-run", "--estimate")
    assert code == 1 and "NaN/Inf" in stderr  # --estimate does read the data


@pytest.mark.slow
def test_dry_run_does_not_import_torch(samples: Path) -> None:
    import subprocess

    code = (
        "import sys; from qtool.cli import main\n"
        f"try:\n    main(['quantize', {str(samples / MLP)!r}, '--dry-run'])\n"
        "except SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_estimate_gives_the_figures_of_a_real_run(invoke: Invoke, samples: Path) -> None:
    _, dry, _ = invoke("quantize", str(samples / MLP), "--dry-run", "--estimate", "--json")
    _, real, _ = invoke("quantize", str(samples / MLP), "--json")
    strip = ("dry_run", "device")
    a = {k: v for k, v in json.loads(dry).items() if k not in strip}
    b = {k: v for k, v in json.loads(real).items() if k not in strip}
    assert a == b


def test_sort_and_top(invoke: Invoke, samples: Path) -> None:
    args = ["quantize", str(samples / MLP), "--per-tensor", "--json", "--force"]
    _, stdout, _ = invoke(*args, "--sort", "sqnr", "--top", "2")
    doc = json.loads(stdout)
    assert [t["name"] for t in doc["tensors"]] == ["head.weight", "embed.weight"]
    assert doc["totals"]["tensors"] == 11  # totals cover every tensor
    _, stdout, _ = invoke(*args, "--sort", "name")
    names = [t["name"] for t in json.loads(stdout)["tensors"]]
    assert names == sorted(names)
    _, stdout, _ = invoke(*args, "--sort", "size", "--top", "1")
    assert json.loads(stdout)["tensors"][0]["name"] == "embed.weight"


# ---- plots ----------------------------------------------------------------------------------


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plots_are_pngs_of_the_documented_size(invoke: Invoke, samples: Path) -> None:
    pytest.importorskip("matplotlib")
    from qtool.engine.plots import FIGURE_PX

    report = samples / "report.png"
    q = samples / "q.safetensors"
    assert invoke("quantize", str(samples / MLP), "-o", str(q), "--plot", str(report))[0] == 0
    cmp = samples / "cmp.png"
    assert invoke("compare", str(samples / MLP), str(q), "--plot", str(cmp))[0] == 0
    code, stdout, _ = invoke("plot", str(samples / MLP), "--tensor", "head.weight")
    assert code == 0 and "mlp.head.weight.png" in stdout
    for png in (report, cmp, samples / "mlp.head.weight.png"):
        assert _png_size(png) == FIGURE_PX
        assert png.stat().st_size > 10_000


def test_plot_errors(invoke: Invoke, samples: Path) -> None:
    code, _, stderr = invoke("plot", str(samples / MLP), "--tensor", "nope")
    assert code == 1 and "no such tensor" in stderr
    code, _, stderr = invoke("plot", str(samples / MLP), "--tensor", "position_ids")
    assert code == 1 and "float tensors" in stderr


def test_plot_without_matplotlib_fails_clearly(
    invoke: Invoke, samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, stdout, stderr = invoke("plot", str(samples / MLP), "--tensor", "head.weight")
    assert code == 1 and stdout == ""
    assert "pip install 'qtool[plot]'" in stderr
