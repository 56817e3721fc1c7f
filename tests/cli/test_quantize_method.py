"""`qtool quantize --method gptq` from the command line: a run on the tiny model says per tensor
which method made it (table note, JSON decided_by) and how many Linears kept GPTQ; what the
method cannot do is refused in one line before anything is read (exit 2 for the command line,
exit 1 for an input it cannot run), with stdout empty."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import Invoke

pytest.importorskip("transformers")

from tests.eval_models import build  # noqa: E402

TEXT = " ".join(f"alpha {i} beta {i * 7 % 13} gamma." for i in range(80))
TINY_LM = Path(__file__).parents[2] / "sample_weights" / "tiny-lm"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("method")
    (root / "calib.txt").write_text(TEXT)
    return build(root / "llama", "llama")


def _args(model: Path, *more: str, text: Path | None = None) -> list[str]:
    text = text or model.parent / "calib.txt"
    return ["quantize", str(model), "--method", "gptq", "--text", str(text), "--tokens", "256",
            "--ctx", "32", "--dtype", "int4", "--group-size", "16", *more]  # fmt: skip


def test_a_run_says_which_method_made_each_tensor(
    model: Path, tmp_path: Path, invoke: Invoke
) -> None:
    """The default check text (CPython's LICENSE.txt) on the sample tiny-lm, JSON and table."""
    text = model.parent / "calib.txt"
    rc, stdout, err = invoke(*_args(TINY_LM, "-o", str(tmp_path / "a"), "--json", text=text))
    assert rc == 0, err
    rows = {r["name"]: r for r in json.loads(stdout)["tensors"]}
    linears = [r for r in rows.values() if r["decided_by"]["origin"] == "calibrated"]
    assert len(linears) == 14
    assert {r["decided_by"]["method"] for r in linears} <= {"gptq", "rtn"}
    assert all("% check text" in r["detail"] for r in linears)
    rc, stdout, err = invoke(*_args(TINY_LM, "-o", str(tmp_path / "b"), text=text))
    assert rc == 0, err
    assert "gptq kept for" in err and "Linear layers of the decoder blocks" in err
    assert "(gptq: " in stdout or "(rtn, gptq: " in stdout


@pytest.mark.parametrize(
    ("more", "words"),
    [
        (["--format", "gguf"], "not GGUF types"),
        (["--target-sqnr", "30"], "drop one of them"),
        (["--dry-run"], "add --estimate"),
        (["--tokens", "32"], "at least two windows"),
        (["--tolerance", "0.1", "--guard", "domain"], "means nothing with --guard domain"),
        (["--tolerance", "-1"], "must be 0 or more"),
    ],
)
def test_what_the_method_cannot_do_is_a_usage_error(
    model: Path, tmp_path: Path, invoke: Invoke, more: list[str], words: str
) -> None:
    rc, stdout, err = invoke(*_args(model, "-o", str(tmp_path / "out"), *more))
    assert (rc, stdout) == (2, ""), err
    assert words in err.strip().splitlines()[-1], err  # qtool's main() prints that line alone
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", [["--text", "x.txt"], ["--guard", "both"], ["--tokens", "64"]])
def test_its_options_without_method_are_usage_errors(
    model: Path, tmp_path: Path, invoke: Invoke, flag: list[str]
) -> None:
    rc, stdout, err = invoke("quantize", str(model), "-o", str(tmp_path / "o"), *flag)
    assert (rc, stdout) == (2, "") and "goes only with --method" in err, err


def test_a_gguf_dtype_is_refused(model: Path, tmp_path: Path, invoke: Invoke) -> None:
    rc, stdout, err = invoke("quantize", str(model), "--method", "gptq", "--dtype", "Q4_K",
                             "--format", "gguf", "-o", str(tmp_path / "o.gguf"))  # fmt: skip
    assert (rc, stdout) == (2, "") and "not GGUF types" in err, err


def test_a_single_tensor_file_is_refused(model: Path, tmp_path: Path, invoke: Invoke) -> None:
    out = tmp_path / "o.safetensors"
    text = model.parent / "calib.txt"
    rc, stdout, err = invoke(*_args(model / "model.safetensors", "-o", str(out), text=text))
    assert (rc, stdout) == (2, ""), err
    assert not out.exists()
    assert "runs the model: give its model directory" in err and "Traceback" not in err


def test_an_architecture_it_cannot_run_is_refused(
    model: Path, tmp_path: Path, invoke: Invoke
) -> None:
    other = tmp_path / "gpt2-like"
    shutil.copytree(model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"model_type": "olmo"}))
    rc, stdout, err = invoke(*_args(other, "-o", str(tmp_path / "o")))
    assert (rc, stdout) == (1, ""), err
    assert "runs the Llama family" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()
