"""What a new user reads (issue 21, items 4, 9 and 11): --all against --top, error messages that
say what happened and what to type, usage errors before any work, and no noise."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from qtool.cli import main
from tests.conftest import Invoke

MLP = "mlp.safetensors"


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The real entry point in process: Typer's usage errors are worded there."""
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


def table_names(stdout: str) -> list[str]:
    return re.findall(r"^ (\S+)\s+\[", stdout, re.MULTILINE)


# ---- 4: --all overrides --top ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["quantize", "compare"])
def test_all_overrides_top(invoke: Invoke, samples: Path, command: str) -> None:
    """`--top 2 --all` shows every row, as the "--all shows every one" hint promises."""
    src = str(samples / MLP)
    args = ["quantize", src, "--dry-run"] if command == "quantize" else ["compare", src, src]
    code, stdout, _ = invoke(*args, "--top", "2")
    assert code == 0 and len(table_names(stdout)) == 2
    assert "(showing 2 of 11 tensors; --all shows every one)" in stdout
    code, stdout, _ = invoke(*args, "--top", "2", "--all")
    assert code == 0 and len(table_names(stdout)) == 11 and "showing" not in stdout
    code, stdout, _ = invoke(*args, "--top", "2", "--all", "--json")
    assert code == 0 and len(json.loads(stdout)["tensors"]) == 11


def test_top_without_sort_shows_the_worst(invoke: Invoke, samples: Path, tmp_path: Path) -> None:
    """`--top N` alone keeps the N lowest-SQNR tensors (table and JSON), not the first N names:
    a user asking for the top rows wants the ones to look at, never a kept bias."""
    args = ["compare", str(samples / MLP), str(tmp_path / "q.safetensors"), "--top", "3"]
    assert invoke("quantize", args[1], "-o", args[2], "--dtype", "int4")[0] == 0
    _, every, _ = invoke(*args[:3], "--json")
    rows = [t for t in json.loads(every)["tensors"] if isinstance(t.get("sqnr_db"), float)]
    worst = [t["name"] for t in sorted(rows, key=lambda t: t["sqnr_db"])[:3]]
    code, stdout, _ = invoke(*args)
    assert code == 0 and table_names(stdout) == worst
    code, stdout, _ = invoke(*args, "--json")
    assert code == 0 and [t["name"] for t in json.loads(stdout)["tensors"]] == worst


# ---- 9: messages that say what happened -------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "what"),
    [
        (MLP, "not a quantized file: a float checkpoint"),
        ("mlp.pt", "not a quantized file: a float checkpoint"),
        ("sharded-mlp", "not a quantized file: a float checkpoint"),
        ("ct/model.safetensors", "is a compressed-tensors checkpoint"),
    ],
    ids=["safetensors", "pt", "sharded", "ct-shard"],
)
def test_dequantize_of_what_is_not_a_qtool_file_says_what_it_is(
    invoke: Invoke, samples: Path, name: str, what: str
) -> None:
    ct = samples / "ct"
    args = ["quantize", str(samples / "tiny-llama"), "--format", "compressed-tensors", "-o"]
    assert invoke(*args, str(ct))[0] == 0
    code, stdout, stderr = invoke("dequantize", str(samples / name))
    assert code == 1 and stdout == "" and stderr.count("\n") == 1
    assert what in stderr and "no qparams sidecar" not in stderr, stderr


def test_dequantize_of_a_model_directory_with_qparams_is_a_usage_error(
    invoke: Invoke, samples: Path
) -> None:
    """--qparams was silently ignored for a compressed-tensors directory."""
    q, ct = samples / "q.safetensors", samples / "ct"
    assert invoke("quantize", str(samples / MLP), "-o", str(q))[0] == 0
    args = ["quantize", str(samples / "tiny-llama"), "--format", "compressed-tensors", "-o"]
    assert invoke(*args, str(ct))[0] == 0
    out = samples / "r.safetensors"
    qparams = str(samples / "q.qparams.safetensors")
    code, _, stderr = invoke("dequantize", str(ct), "--qparams", qparams, "-o", str(out))
    assert code == 2 and "keeps its scales inside; give no sidecar" in stderr
    assert not out.exists()


def test_dequantize_without_the_sidecar_still_asks_for_it(invoke: Invoke, samples: Path) -> None:
    q = samples / "q.safetensors"
    assert invoke("quantize", str(samples / MLP), "-o", str(q))[0] == 0
    (samples / "q.qparams.safetensors").rename(samples / "elsewhere.safetensors")
    code, _, stderr = invoke("dequantize", str(q))
    assert code == 1 and "no qparams sidecar for q.safetensors" in stderr


def test_plot_of_a_quantized_file_says_so_and_what_to_do(invoke: Invoke, samples: Path) -> None:
    pytest.importorskip("matplotlib")
    q = samples / "q.safetensors"
    assert invoke("quantize", str(samples / MLP), "-o", str(q))[0] == 0
    code, stdout, stderr = invoke("plot", str(q), "-t", "head.weight", "-o", str(samples / "p.png"))
    assert code == 1 and stdout == "" and "codes of codes" not in stderr
    assert "is a qtool-quantized file, not a float checkpoint" in stderr
    assert "give the original float checkpoint" in stderr and "compare" in stderr
    assert not (samples / "p.png").exists()


def test_plot_suggests_the_tensor_meant(invoke: Invoke, samples: Path) -> None:
    pytest.importorskip("matplotlib")
    code, _, stderr = invoke("plot", str(samples / MLP), "-t", "head.wieght")
    assert code == 1 and "tensor 'head.wieght': no such tensor; did you mean head.weight" in stderr
    code, _, stderr = invoke("plot", str(samples / MLP), "-t", "zzz")
    assert code == 1 and "did you mean" not in stderr and "qtool inspect" in stderr


@pytest.mark.parametrize(
    ("content", "what"),
    [
        (None, "plain text"),  # the README itself
        (
            b"version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n",
            "a Git LFS pointer",
        ),
        (b"<!DOCTYPE html>\n<html><body>404</body></html>\n", "an HTML page"),
    ],
    ids=["text", "lfs-pointer", "html"],
)
def test_inspect_names_what_a_non_checkpoint_is(
    invoke: Invoke, tmp_path: Path, content: bytes | None, what: str
) -> None:
    path = Path(__file__).parents[2] / "README.md"
    if content is not None:
        path = tmp_path / "model.safetensors"
        path.write_bytes(content)
    code, _, stderr = invoke("inspect", str(path))
    assert code == 1 and f"not a checkpoint: {what}" in stderr
    assert "header length" not in stderr, stderr


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["quantize", "{s}", "--bits", "4"], "no such option: --bits; did you mean --dtype int4?"),
        (["quantize", "{s}", "--bits=8"], "no such option: --bits; did you mean --dtype int8?"),
        (["quantize", "{s}", "--output", "x"], "no such option: --output; did you mean --out?"),
        (["quantize", "{s}", "--symmetric"], "did you mean --scheme sym?"),
        (["quantize", "{s}", "--shceme", "asym"], "--shceme; did you mean --scheme?"),
        (["plot", "{s}", "--name", "x"], "no such option: --name; did you mean --tensor?"),
        (["inspect", "{s}", "--bits", "4"], "no such option: --bits; see qtool inspect --help"),
        (["quantize", "{s}", "--config", "c.json"], "--config: goes with --format compressed-"),
        (["quantize", "{s}", "--group-fallback", "keep"], "--group-fallback: goes with --format"),
        (["quantize"], "missing argument INPUT; usage: qtool quantize [OPTIONS] INPUT"),
        (["plot", "{s}"], "missing option --tensor (-t); usage: qtool plot [OPTIONS] CHECKPOINT"),
    ],
    ids=["bits", "bits=", "output", "symmetric", "typo", "plot-name", "not-offered", "config",
         "group-fallback", "no-input", "no-tensor"],
)  # fmt: skip
def test_usage_errors_say_what_to_type(
    samples: Path, capsys: pytest.CaptureFixture[str], args: list[str], line: str
) -> None:
    args = [a.format(s=samples / MLP) for a in args]
    code, out, err = run_main(capsys, *args)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert line in err and "Possible options" not in err, err


@pytest.mark.parametrize(
    "args",
    [
        ["--format", "compressed-tensors", "-o", "{d}/out", "--dtype", "uint8"],
        ["--format", "compressed-tensors", "-o", "{d}/out", "--dtype", "uint4"],
        ["--format", "compressed-tensors", "-o", "{d}/out", "--axis", "1"],
        ["--config", "{d}/config.json"],
        ["--dry-run", "--plot", "{d}/p.png"],
        ["--dry-run", "--min-sqnr", "30"],
        ["--estimate"],
        ["--per-tensor", "--group-size", "32"],
    ],
    ids=["ct-uint8", "ct-uint4", "ct-axis", "config", "dry-run-plot", "dry-run-gate", "estimate",
         "per-tensor-groups"],
)  # fmt: skip
def test_option_conflicts_are_usage_errors_before_any_work(
    samples: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
) -> None:
    """Exit 2 before the engine is asked to do anything."""

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine ran")

    monkeypatch.setattr(importlib.import_module("qtool.api"), "quantize", no_work)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    args = [a.format(d=outputs) for a in args]
    code, out, err = run_main(capsys, "quantize", str(samples / "tiny-llama"), *args)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert list(outputs.iterdir()) == []


def test_ct_dtype_conflict_names_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--format", "compressed-tensors", "-o", str(tmp_path / "o"), "--dtype", "uint8"]
    code, _, err = run_main(capsys, "quantize", str(tmp_path / "m"), *args, "--json")
    doc = json.loads(err)["error"]
    assert code == 2 and doc["code"] == "usage"
    assert doc["message"].startswith("--dtype: compressed-tensors stores signed codes")


# ---- 11: noise and wording ----------------------------------------------------------------------


def test_the_ignore_line_only_when_a_linear_is_kept(invoke: Invoke, samples: Path) -> None:
    model = str(samples / "tiny-llama")
    args = ["quantize", model, "--format", "compressed-tensors", "--dry-run", "-o"]
    code, _, stderr = invoke(*args, str(samples / "a"))
    assert code == 0 and "qtool: ignore (Linear layers kept in float): lm_head" in stderr
    every = ["--include", "*proj.weight", "--include", "lm_head.weight"]
    code, _, stderr = invoke(*args, str(samples / "b"), *every)
    assert code == 0 and "ignore" not in stderr, stderr


def test_kept_tensors_are_worded_alike_in_both_formats(invoke: Invoke, samples: Path) -> None:
    def kept(*args: str) -> dict[str, str]:
        code, stdout, _ = invoke("quantize", *args, "--dry-run", "--json")
        assert code == 0
        rows = json.loads(stdout)["tensors"]
        return {r["name"]: r["detail"] for r in rows if len(r["shape"]) < 2}

    model = samples / "tiny-llama"
    qtool = kept(str(model / "model.safetensors"))
    ct = kept(str(model), "--format", "compressed-tensors", "-o", str(samples / "ct"))
    assert qtool == ct and set(ct.values()) == {"kept: 1-D (bias/norm)"}


def _bar_colors(sqnr: list[float]) -> tuple[list[Any], list[str]]:
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    from qtool.engine import plots
    from qtool.engine.plots import _sqnr_bars
    from qtool.results import ErrorStats, QuantizeRow

    rows = []
    for i, db in enumerate(sqnr):  # energy 1: a squared error of 10^(-db/10)
        stats = ErrorStats(16, 10 ** (-db / 10), 1.0, 0.1)
        rows.append(QuantizeRow(f"layers.{i}.w", (4, 4), "F32", "I8", True, "sym", 64, 16,
                                errors=stats))  # fmt: skip
    fig, ax = plt.subplots()
    _sqnr_bars(ax, rows, "t", None)
    colors = [p.get_facecolor() for p in ax.patches]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(fig)
    red = to_rgba(plots._WORST_COLOR)
    return [c == red for c in colors], labels


def test_red_bars_mark_outliers_not_the_worst_three() -> None:
    """Four similar layers: no red bar (never three of four); one layer far below the median:
    that one; -inf always."""
    pytest.importorskip("matplotlib")
    red, labels = _bar_colors([44.6, 45.0, 45.3, 47.1])
    assert red == [False] * 4 and not any("worst" in label for label in labels)
    red, labels = _bar_colors([44.6, 25.0, 45.3, 47.1])
    assert red == [False, True, False, False] and "3+ dB below the median" in labels
    red, _ = _bar_colors([30.0 + i for i in range(10)] + [10.0, 12.0, 14.0, 16.0])
    assert sum(red) == 3 and red[-4:] == [True, True, True, False]


def test_plot_text_has_no_stray_separator_line(
    invoke: Invoke, samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from qtool.engine import plots

    texts: list[str] = []

    def keep_texts(fig: Any, *args: object) -> None:
        texts.extend(t.get_text() for ax in fig.axes for t in ax.texts)
        texts.append(fig._suptitle.get_text())

    monkeypatch.setattr(plots, "_save", keep_texts)
    args = ["plot", str(samples / MLP), "-t", "head.weight", "-o", str(samples / "p.png")]
    assert invoke(*args)[0] == 0
    lines = [line.strip() for text in texts for line in text.splitlines()]
    assert "sym int8 axis 0" in lines and any(line.startswith("MSE") for line in lines)
    assert "·" not in lines, texts
