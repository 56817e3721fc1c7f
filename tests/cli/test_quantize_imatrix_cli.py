"""`qtool quantize --imatrix` on the command line: the wSQNR column and the weighted total in
an 80-column table, the JSON keys (docs/json.md), and the combinations refused before any file
is read (exit 2, one line, stdout empty)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qtool.formats.imatrix import write_imatrix
from qtool.formats.imatrix.naming import llama_names
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats
from tests.conftest import SAMPLES, Invoke

TINY_LM = SAMPLES / "tiny-lm"
SHAPES = {
    f"model.layers.{b}.{part}.weight": (0, k)
    for b in range(2)
    for part, k in [
        ("self_attn.q_proj", 64), ("self_attn.k_proj", 64), ("self_attn.v_proj", 64),
        ("self_attn.o_proj", 64), ("mlp.gate_proj", 64), ("mlp.up_proj", 64),
        ("mlp.down_proj", 128),
    ]
}  # fmt: skip


def _imatrix(path: Path) -> Path:
    names = llama_names("llama", 2, list(SHAPES))
    rng = np.random.default_rng(1)
    entries = {
        names[n]: MatrixStats(
            (rng.random((1, k), dtype=np.float32) ** 6 * 100).astype(np.float32),
            np.array([10], dtype=np.int64),
        )
        for n, (_, k) in SHAPES.items()
    }
    write_imatrix(path, ImportanceMatrix(entries, 512, 1, ("calib.txt",)))
    return path


ARGS = ("--dtype", "int4", "--group-size", "32", "--range", "mse")


def _rule_width(out: str) -> int:
    return max(len(line) for line in out.splitlines() if "───" in line)


def test_table_shows_the_weighted_sqnr_in_80_columns(tmp_path: Path, invoke: Invoke) -> None:
    """wSQNR beside SQNR dB; at 80 columns the table widens by that column alone (the long
    names of a piped table stay whole, so neither table fits 80 columns exactly)."""
    imatrix = _imatrix(tmp_path / "m.gguf")
    env = {"COLUMNS": "80"}
    code, out, err = invoke(
        "quantize", str(TINY_LM), "-o", str(tmp_path / "q"), *ARGS, "--imatrix", str(imatrix),
        env=env,
    )  # fmt: skip
    assert code == 0, err
    header = next(line for line in out.splitlines() if "SQNR dB" in line)
    assert header.rstrip().endswith("SQNR dB  wSQNR")
    assert "weighted SQNR" in out
    code, plain, err = invoke("quantize", str(TINY_LM), "-o", str(tmp_path / "p"), *ARGS, env=env)
    assert code == 0, err
    assert "wSQNR" not in plain
    assert _rule_width(out) <= _rule_width(plain) + len("  wSQNR")


def test_json_has_the_weighted_sqnr_and_the_provenance(tmp_path: Path, invoke: Invoke) -> None:
    imatrix = _imatrix(tmp_path / "m.gguf")
    code, out, err = invoke(
        "quantize", str(TINY_LM), "-o", str(tmp_path / "q"), *ARGS, "--imatrix", str(imatrix),
        "--json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    rows = {t["name"]: t for t in doc["tensors"]}
    assert isinstance(rows["model.layers.0.self_attn.q_proj.weight"]["weighted_sqnr_db"], float)
    assert "weighted_sqnr_db" not in rows["model.norm.weight"]
    assert isinstance(doc["totals"]["weighted_sqnr_db"], float)
    assert doc["imatrix"]["entries_count"] == 14
    assert doc["imatrix"]["datasets"][0]["name"] == "calib.txt"
    # without --imatrix, none of these keys
    code, out, _ = invoke("quantize", str(TINY_LM), "-o", str(tmp_path / "p"), *ARGS, "--json")
    plain = json.loads(out)
    assert "imatrix" not in plain and "weighted_sqnr_db" not in plain["totals"]


def test_refused_combinations_exit_2_before_reading(tmp_path: Path, invoke: Invoke) -> None:
    missing = tmp_path / "absent.gguf"  # never read: the usage error comes first
    for extra, words in [
        (["--target-sqnr", "30"], "error budget"),
        (["--method", "gptq"], "--method chooses its codes"),
    ]:
        code, out, err = invoke(
            "quantize", str(SAMPLES / "tiny-llama.gguf"), "-o", str(tmp_path / "o"), *extra,
            "--imatrix", str(missing),
        )  # fmt: skip
        assert code == 2, err
        assert out == "" and words in err and "--imatrix" in err


@pytest.mark.parametrize("fmt", ["qtool", "compressed-tensors"])
def test_an_imatrix_that_would_weigh_nothing_is_refused(
    tmp_path: Path, invoke: Invoke, fmt: str
) -> None:
    """Min-max ranges take no weights: the codes were those of a run without --imatrix, yet
    the output recorded the imatrix as used. A usage error before the file is read (GGUF
    types take it in ggml's quantizers; a recipe may set --range per tensor)."""
    missing = tmp_path / "absent.gguf"
    code, out, err = invoke(
        "quantize", str(TINY_LM), "-o", str(tmp_path / "q"), "--format", fmt,
        "--dtype", "int8", "--imatrix", str(missing),
    )  # fmt: skip
    assert code == 2 and out == "", err
    assert "--imatrix: weighs the range search: add --range mse" in err, err
    assert not (tmp_path / "q").exists()


def test_a_missing_file_is_one_line_exit_1(tmp_path: Path, invoke: Invoke) -> None:
    code, out, err = invoke(
        "quantize", str(TINY_LM), "-o", str(tmp_path / "q"), *ARGS,
        "--imatrix", str(tmp_path / "absent.gguf"),
    )  # fmt: skip
    assert code == 1 and out == ""
    assert "absent.gguf" in err and "Traceback" not in err
    assert not (tmp_path / "q").exists()
