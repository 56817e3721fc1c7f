"""What a new user meets first (issue 8, items 6, 8, 9, 11-16): usage errors, output names,
warnings, messages, piped tables, name order, plots and help texts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qtool.cli import main
from tests.conftest import Invoke

MLP = "mlp.safetensors"
README = Path(__file__).parents[2] / "README.md"
JSON_DOC = README.parent / "docs" / "json.md"


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The real entry point in process: usage errors are formatted there, not by Typer."""
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


# ---- usage errors (12, 8) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["quantize", "{s}", "--scheme", "foo"], "--scheme: 'foo' is not one of sym, asym"),
        (["quantize", "{s}", "--top", "0"], "--top: must be at least 1"),
        (["quantize", "{s}", "--axis", "x"], "--axis: expects a whole number"),
        (["quantize", "{s}", "--per-tensor", "--axis", "1"], "--axis: goes with --per-channel"),
        (["plot", "{s}", "-t", "head.weight", "--per-tensor", "--axis", "1"], "--axis: goes with"),
        (["dequantize", "{s}", "--to", "float8"], "--to: 'float8' is not one of original,"),
        (["compare", "{s}"], "missing argument B; usage: qtool compare [OPTIONS] A B"),
    ],
    ids=["choice", "range", "integer", "axis-per-tensor", "plot-axis", "dequantize-to", "missing"],
)
def test_usage_errors_are_one_line_exit_2(
    samples: Path, capsys: pytest.CaptureFixture[str], args: list[str], line: str
) -> None:
    args = [a.format(s=samples / MLP) for a in args]
    code, out, err = run_main(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("qtool: error: " + line) and err.count("\n") == 1, err
    assert "Value error" not in err and "Usage:" not in err
    code, out, err = run_main(capsys, *args, "--json")
    doc = json.loads(err)
    assert code == 2 and out == "" and doc["ok"] is False and doc["error"]["code"] == "usage"
    assert doc["error"]["message"].startswith(line)


def test_plot_has_json(invoke: Invoke, samples: Path) -> None:
    pytest.importorskip("matplotlib")
    png = samples / "h.png"
    code, stdout, _ = invoke(
        "plot", str(samples / MLP), "-t", "head.weight", "-o", str(png), "--json"
    )
    doc = json.loads(stdout)
    assert code == 0 and doc["command"] == "plot" and doc["outputs"] == [str(png)]
    assert doc["tensor"] == "head.weight" and isinstance(doc["sqnr_db"], float)


# ---- output names (6) --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "accepted"),
    [
        (["quantize", "{s}", "-o", "{d}/x.pt"], "writes .safetensors files"),
        (["quantize", "{s}", "-o", "{d}/x"], "writes .safetensors files"),
        (["quantize", "{s}", "-o", "{d}/x.gguf"], "writes .safetensors files"),
        (["quantize", "{s}", "--dry-run", "-o", "{d}/x.pt"], "writes .safetensors files"),
        (["quantize", "{s}", "--plot", "{d}/x.jpg"], "writes .png files"),
        (["quantize", "{p}/sharded-mlp", "-o", "{d}/x.safetensors"], "writes a directory"),
        (["dequantize", "{q}", "-o", "{d}/x.npz"], "writes .safetensors or .pt or .pth or .bin"),
        (["plot", "{s}", "-t", "head.weight", "-o", "{d}/x.jpg"], "writes .png files"),
    ],
    ids=["pt", "no-ext", "gguf", "dry-run", "plot-flag", "sharded", "dequantize-npz", "plot"],
)
def test_output_names_a_command_cannot_honour_are_usage_errors(
    invoke: Invoke, samples: Path, args: list[str], accepted: str
) -> None:
    q = samples / "q.safetensors"
    assert invoke("quantize", str(samples / MLP), "-o", str(q))[0] == 0
    out_dir = samples / "out"
    out_dir.mkdir()
    args = [a.format(s=samples / MLP, d=out_dir, q=q, p=samples) for a in args]
    code, stdout, stderr = invoke(*args)
    assert code == 2 and stdout == "", stderr
    assert accepted in stderr and stderr.count("\n") == 1
    assert list(out_dir.iterdir()) == []


def test_an_existing_directory_gets_the_default_name(invoke: Invoke, samples: Path) -> None:
    out = samples / "out"
    out.mkdir()
    assert invoke("quantize", str(samples / MLP), "-o", str(out))[0] == 0
    assert (out / "mlp.int8.safetensors").is_file()
    assert (out / "mlp.int8.qparams.safetensors").is_file()
    assert invoke("dequantize", str(out / "mlp.int8.safetensors"), "-o", str(out))[0] == 0
    assert (out / "mlp.int8.dequantized.safetensors").is_file()


def test_dequantize_pt_output_is_a_real_torch_file(invoke: Invoke, samples: Path) -> None:
    q = samples / "q.safetensors"
    assert invoke("quantize", str(samples / MLP), "-o", str(q))[0] == 0
    assert invoke("dequantize", str(q), "-o", str(samples / "r.pt"), "--to", "float16")[0] == 0
    state = torch.load(samples / "r.pt", weights_only=True)
    assert state["head.weight"].dtype == torch.float16


def test_old_dtype_spelling_still_works_hidden(invoke: Invoke, samples: Path) -> None:
    q = samples / "q.safetensors"
    assert invoke("quantize", str(samples / MLP), "-o", str(q))[0] == 0
    code, stdout, _ = invoke("dequantize", str(q), "--dtype", "bfloat16", "--json")
    assert code == 0 and "restored" in stdout
    restored = samples / "q.dequantized.safetensors"
    doc = json.loads(invoke("inspect", str(restored), "--json")[1])
    assert {t["dtype"] for t in doc["tensors"] if t["name"] == "head.weight"} == {"BF16"}
    assert "--dtype" not in invoke("dequantize", "--help")[1]


# ---- silent mistakes (8) -----------------------------------------------------------------------


def test_globs_that_match_nothing_and_empty_runs_warn(invoke: Invoke, samples: Path) -> None:
    code, stdout, stderr = invoke(
        "quantize", str(samples / MLP), "--dry-run", "--include", "layer.*", "--exclude", "x*"
    )
    assert code == 0
    assert "--include 'layer.*' matches no tensor name" in stderr
    assert "--exclude 'x*' matches no tensor name" in stderr
    assert "0 of 11 tensors selected for quantization" in stderr
    code, _, stderr = invoke("quantize", str(samples / MLP), "--dry-run", "--include", "*.weight")
    assert code == 0 and stderr == ""


# ---- compare of sharded sets (9) ---------------------------------------------------------------


def test_compare_sharded_sets_by_tensor_name(invoke: Invoke, samples: Path) -> None:
    sharded = samples / "sharded-mlp"
    out = samples / "sq"
    assert invoke("quantize", str(sharded), "-o", str(out))[0] == 0
    code, stdout, stderr = invoke("compare", str(sharded), str(out), "--json")
    assert code == 0, stderr
    doc = json.loads(stdout)
    assert doc["totals"] == doc["totals"] | {"tensors": 11, "compared": 11, "mismatches": 0}
    code, stdout, stderr = invoke("compare", str(sharded), str(samples / MLP), "--json")
    assert code == 0, stderr  # a sharded set against one file: tensor by tensor, by name
    assert json.loads(stdout)["totals"]["compared"] == 11


# ---- misleading messages (13) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "name", "message"),
    [
        ("quantize", "config.json", "not a checkpoint: JSON text"),
        ("inspect", "config.json", "not a checkpoint: JSON text"),
        ("inspect", "w.npz", "not a checkpoint: a numpy .npz archive"),
        ("quantize", "w.npz", "not a checkpoint: a numpy .npz archive"),
        ("inspect", "w.npy", "not a checkpoint: a numpy .npy array"),
        ("dequantize", "q.qparams.safetensors", "this is a qparams sidecar; pass the quantized"),
    ],
)
def test_messages_say_what_the_file_is(
    invoke: Invoke, samples: Path, command: str, name: str, message: str
) -> None:
    import numpy as np

    (samples / "config.json").write_text('{\n  "hidden_size": 384, "model_type": "bert"}\n')
    np.savez(samples / "w.npz", a=np.zeros(3))
    np.save(samples / "w.npy", np.zeros(3))
    assert invoke("quantize", str(samples / MLP), "-o", str(samples / "q.safetensors"))[0] == 0
    code, stdout, stderr = invoke(command, str(samples / name))
    assert code == 1 and stdout == "" and message in stderr, stderr
    assert stderr.count("\n") == 1 and "torch pickle" not in stderr


def test_a_wrong_qparams_file_says_what_to_pass(invoke: Invoke, samples: Path) -> None:
    q = samples / "q.safetensors"
    assert invoke("quantize", str(samples / MLP), "-o", str(q))[0] == 0
    code, _, stderr = invoke("dequantize", str(q), "--qparams", str(samples / MLP))
    assert code == 1 and "the .qparams.safetensors file written beside" in stderr


# ---- piped tables and name order (14) ----------------------------------------------------------

LONG = "encoder.layer.{}.attention.output.LayerNorm.weight"


def test_piped_tables_never_wrap_names_and_plans_drop_empty_columns(
    invoke: Invoke, tmp_path: Path
) -> None:
    names = [LONG.format(i) for i in (0, 2, 10)]
    save_file({n: torch.randn(8, 8) for n in names}, tmp_path / "m.safetensors")
    for columns in ("60", "120"):
        code, stdout, _ = invoke(
            "quantize", str(tmp_path / "m.safetensors"), "--dry-run", env={"COLUMNS": columns}
        )
        assert code == 0
        lines = stdout.splitlines()
        assert all(any(n in line for line in lines) for n in names), stdout
        assert "MSE" not in stdout and "SQNR" not in stdout.splitlines()[2]


def test_natural_name_order_for_sort_and_inspect(invoke: Invoke, tmp_path: Path) -> None:
    names = [f"layers.{i}.weight" for i in (10, 2, 1)]
    tensors = {n: torch.randn(4, 4) for n in names} | {"a.bias": torch.zeros(4, dtype=torch.int64)}
    save_file(tensors, tmp_path / "m.safetensors")
    expected = ["a.bias", "layers.1.weight", "layers.2.weight", "layers.10.weight"]
    doc = json.loads(invoke("inspect", str(tmp_path / "m.safetensors"), "--json")[1])
    assert [t["name"] for t in doc["tensors"]] == expected
    doc = json.loads(
        invoke(
            "quantize", str(tmp_path / "m.safetensors"), "--dry-run", "--sort", "name", "--json"
        )[1]
    )
    assert [t["name"] for t in doc["tensors"]] == expected


# ---- plots (15) --------------------------------------------------------------------------------


def test_plot_labels_keep_both_ends_of_a_name() -> None:
    from qtool.engine.plots import short_label

    label = short_label("encoder.layer.11.attention.self.query.weight", 30)
    assert len(label) == 30 and label.startswith("encoder.layer.11") and label.endswith("weight")
    assert short_label("head.weight") == "head.weight"


def test_heatmap_blocks_keep_an_outlier_channel() -> None:
    from qtool.engine.plots import block_extreme

    grid = torch.zeros(600, 700)
    grid[301, 5] = -9.0  # a strided sample (rows 0, 3, 6, ...) would never show row 301
    shown = block_extreme(grid, 3, 3)
    assert shown.shape == (200, 234) and shown[100, 1] == -9.0 and shown.abs().sum() == 9.0


def test_sqnr_bars_mark_exact_layers_and_the_gate() -> None:
    pytest.importorskip("matplotlib")
    import math

    import matplotlib.pyplot as plt

    from qtool.engine.plots import _error_histograms, _sqnr_bars
    from qtool.results import ErrorStats, QuantizeRow

    def row(name: str, sq_error: float) -> QuantizeRow:
        stats = ErrorStats(16, sq_error, 1.0, 0.1)
        return QuantizeRow(name, (4, 4), "F32", "I8", True, "sym", 64, 16, errors=stats)

    rows = [row("layers.10.w", 1e-4), row("layers.2.w", 0.0), row("layers.1.w", 1e-3)]
    fig, (ax, hist_ax) = plt.subplots(1, 2)
    _sqnr_bars(ax, rows, "t", min_sqnr=35.0)
    heights = [p.get_height() for p in ax.patches]
    assert heights == pytest.approx([30.0, 0.0, 40.0])  # natural order; exact: no bar
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "exact (error 0)" in labels and "gate --min-sqnr 35 dB" in labels
    assert not any(math.isinf(h) for h in heights)
    _error_histograms([hist_ax], {"w": (torch.randn(100), torch.zeros(100))})
    assert hist_ax.get_yscale() == "log"
    plt.close(fig)


# ---- help texts (16) ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["quantize", "compare", "dequantize", "plot", "inspect"])
def test_help_has_plain_names_and_metavars(invoke: Invoke, command: str) -> None:
    code, out, _ = invoke(command, "--help")
    assert code == 0
    assert not re.search(r"\{[A-Z]+\}", out) and "<list[" not in out and "x>=" not in out
    assert "SRC" not in out and "range>" not in out


def test_top_level_summaries_are_whole(invoke: Invoke) -> None:
    out = invoke("--help")[1]
    assert not re.search(r"\w\.\.\.$", out, re.MULTILINE), out  # Click's cut-off summaries
    assert "Draw one tensor quantized: heatmaps and a value histogram (PNG)." in out


# ---- README (11) -------------------------------------------------------------------------------


def test_readme_says_how_to_run_qtool_and_where_outputs_go() -> None:
    text = README.read_text()
    usage = text[text.index("## Five-minute tour") :]
    first_qtool = usage.index("$ qtool ")
    assert ". .venv/bin/activate" in usage[:first_qtool]
    assert "mkdir -p build/demo" in usage[:first_qtool]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("jq") is None, reason="jq is not installed")
def test_readme_jq_example_selects_quantized_tensors_only(
    invoke: Invoke, samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = re.search(
        r"^\$ (qtool quantize [^\n]*--json) \| jq '([^']+)'$", JSON_DOC.read_text(), re.M
    )
    assert example is not None
    command, query = example[1], example[2]
    monkeypatch.chdir(samples.parent)
    (samples.parent / "sample_weights").symlink_to(samples)
    code, stdout, _ = invoke(*command.split()[1:])
    assert code == 0
    picked = subprocess.run(["jq", "-r", query], input=stdout, capture_output=True, text=True)
    names = set(picked.stdout.split())
    kept = {t["name"] for t in json.loads(stdout)["tensors"] if not t["quantized"]}
    assert picked.returncode == 0 and names and not names & kept
