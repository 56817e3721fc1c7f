"""The messages of the calibrated methods and of calibrate say what happened in their own
words: the spill's failure names the output's directory (not '.') and the method's codes, an
empty calibration text is refused with calibration's wording (not eval's), the count of Linears
a method kept speaks of "the others" only when there are others, and a check text that is the
calibration text is refused (the guard would check the method on what it was fitted to)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from tests.conftest import Invoke

pytest.importorskip("transformers")

from qtool.engine import spill as spill_module  # noqa: E402

TEXT = " ".join(f"alpha {i} beta {i * 7 % 13} gamma." for i in range(80))
TINY_LM = Path(__file__).parents[2] / "sample_weights" / "tiny-lm"


def _gptq(text: Path, *more: str) -> list[str]:
    return ["quantize", str(TINY_LM), "--method", "gptq", "--text", str(text), "--tokens", "256",
            "--ctx", "32", "--dtype", "int4", "--group-size", "16", "--threads", "1",
            *more]  # fmt: skip


@pytest.fixture
def text(tmp_path: Path) -> Path:
    (tmp_path / "calib.txt").write_text(TEXT)
    return tmp_path / "calib.txt"


def test_a_spill_failure_names_the_outputs_directory_and_the_methods_codes(
    tmp_path: Path, text: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    def too_large(*_: object) -> int:
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(f"{spill_module.__name__}.os.pwrite", too_large)
    monkeypatch.chdir(tmp_path)
    rc, stdout, err = invoke(*_gptq(text, "-o", "w"))  # a relative output: its directory is '.'
    assert (rc, stdout) == (1, ""), err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"qtool: error: {os.fspath(tmp_path)}: "), line
    assert "the calibrated method's codes" in line, line


@pytest.mark.parametrize("flag", ["--text", "--check-text"])
def test_an_empty_text_is_refused_in_calibrations_words(
    tmp_path: Path, text: Path, invoke: Invoke, flag: str
) -> None:
    (tmp_path / "empty.txt").write_text(" \n")
    empty = str(tmp_path / "empty.txt")
    more = ("--check-text", empty) if flag == "--check-text" else ()
    args = _gptq(Path(empty) if flag == "--text" else text, *more, "-o", str(tmp_path / "w"))
    rc, stdout, err = invoke(*args)
    assert (rc, stdout) == (1, ""), err
    assert "evaluate on" not in err and "give some text to" in err, err
    out = str(tmp_path / "x.imatrix.gguf")
    calibrate = ["calibrate", str(TINY_LM), "--text", empty, "--tokens", "64", "--ctx", "32",
                 "-o", out]  # fmt: skip
    rc, stdout, err = invoke(*calibrate)
    assert (rc, stdout) == (1, ""), err
    assert "give some text to calibrate on" in err, err


def test_the_others_are_named_only_when_there_are_others(
    tmp_path: Path, text: Path, invoke: Invoke
) -> None:
    rc, _, err = invoke(*_gptq(text, "--guard", "none", "-o", str(tmp_path / "w")))
    assert rc == 0, err
    kept = next(line for line in err.splitlines() if "kept for" in line)
    assert "kept for 14 of 14" in kept and "the others" not in kept, kept


@pytest.mark.parametrize("copy", [False, True], ids=["same file", "same content"])
def test_a_check_text_that_is_the_calibration_text_is_refused(
    tmp_path: Path, text: Path, invoke: Invoke, copy: bool
) -> None:
    check = tmp_path / "check.txt" if copy else text
    check.write_text(TEXT)
    rc, stdout, err = invoke(*_gptq(text, "--check-text", str(check), "-o", str(tmp_path / "w")))
    assert (rc, stdout) == (2, ""), err
    assert "is the calibration text" in err.strip().splitlines()[-1], err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("merge", [False, True], ids=["calibrate", "merge"])
def test_a_dat_output_name_is_refused(
    tmp_path: Path, text: Path, invoke: Invoke, merge: bool
) -> None:
    """qtool writes the GGUF imatrix only: under a .dat name its bytes would be mistaken for
    llama.cpp's legacy format."""
    out = tmp_path / "tl.imatrix.DAT"
    source = [str(tmp_path / "in.imatrix.gguf"), "--merge"] if merge else [str(TINY_LM)]
    rc, stdout, err = invoke("calibrate", *source, "--text", str(text), "-o", str(out))
    assert (rc, stdout) == (2, ""), err
    assert "name it .gguf" in err.strip().splitlines()[-1], err
    assert not out.exists()


def test_fewer_tokens_than_asked_are_said_with_the_windows_used(
    tmp_path: Path, text: Path, invoke: Invoke
) -> None:
    """--tokens far beyond the text ran silently on what the text gave."""
    args = _gptq(text, "-o", str(tmp_path / "w"), "--json")
    args[args.index("--tokens") + 1] = str(10**12)
    rc, stdout, err = invoke(*args)
    assert rc == 0, err
    (note,) = [w for w in json.loads(stdout)["warnings"] if "asked for" in w]
    assert "of the 1,000,000,000,000 asked for" in note and "held out" in note, note
    assert note in err
    rc, stdout, err = invoke(*_gptq(text, "-o", str(tmp_path / "w2"), "--json"))
    assert rc == 0, err
    assert not [w for w in json.loads(stdout)["warnings"] if "asked for" in w]


def test_calibrate_says_when_the_text_gave_fewer_tokens(
    tmp_path: Path, text: Path, invoke: Invoke
) -> None:
    out = tmp_path / "x.imatrix.gguf"
    args = ["calibrate", str(TINY_LM), "--text", str(text), "--ctx", "32", "-o", str(out)]
    rc, stdout, err = invoke(*args, "--tokens", "99999", "--json")
    assert rc == 0, err
    used = json.loads(stdout)["tokens"]
    assert f"gave {used:,} tokens of the 99,968 asked for" in err, err
    rc, stdout, err = invoke(*args, "--tokens", "64", "--force")
    assert rc == 0, err
    assert "asked for" not in err, err
