"""`qtool eval` before any model is loaded (no transformers needed): what start-up imports, and
the --text file read like every other input (regular files only, bounded, UTF-8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SAMPLES, Invoke

PROBE = """
import json, sys
from qtool.cli import main
code = None
try:
    main(json.loads(sys.argv[1]))  # with its arguments: returns (SystemExit), no os._exit
except SystemExit as exit:
    code = exit.code
names = ("torch", "transformers", "rich", "qtool.engine")
sys.stderr.write("\\nLOADED " + json.dumps([m for m in names if m in sys.modules]) + "\\n")
"""


def loaded_by(*args: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True
    )
    return list(json.loads(result.stderr.rsplit("LOADED ", 1)[-1]))


@pytest.mark.slow
def test_eval_help_loads_no_torch_and_no_transformers() -> None:
    assert loaded_by("eval", "--help") == []
    assert "transformers" not in loaded_by("--help")


@pytest.mark.slow
def test_a_bound_for_the_wrong_kind_is_refused_before_torch(tmp_path: Path) -> None:
    model = str(SAMPLES / "tiny-lm")
    assert "torch" not in loaded_by("eval", model, model, "--min-cosine", "0.9")


LM = str(SAMPLES / "tiny-lm")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: os.mkfifo(p), "FIFO"),
        (lambda p: p.mkdir(), "directory"),
        (lambda p: p.write_bytes(b"\x00\xc3\x28"), "not UTF-8 text (byte 0xc3 at offset 1)"),
        (lambda p: p.write_text(" \n\t"), "the text file is empty"),
        (lambda p: None, "no such file"),
    ],
    ids=["fifo", "directory", "not-utf8", "blank", "missing"],
)
def test_bad_text_files_are_one_line_errors(
    invoke: Invoke, tmp_path: Path, make: object, message: str
) -> None:
    path = tmp_path / "text"
    make(path)  # type: ignore[operator]
    code, out, err = invoke("eval", LM, LM, "--text", str(path))
    assert code == 1 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_device_text_is_refused(invoke: Invoke) -> None:
    code, _, err = invoke("eval", LM, LM, "--text", "/dev/zero")
    assert code == 1 and "device" in err


def test_text_over_the_bound_is_refused(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qtool.engine.model import text

    monkeypatch.setattr(text, "MAX_TEXT_BYTES", 10)
    path = tmp_path / "long.txt"
    path.write_text("x" * 11)
    code, _, err = invoke("eval", LM, LM, "--text", str(path))
    assert code == 1 and "over 10 bytes" in err


def test_a_json_error_is_one_object_on_stderr(invoke: Invoke, tmp_path: Path) -> None:
    code, out, err = invoke("eval", str(tmp_path), LM, "--json")
    doc = json.loads(err)
    assert code == 1 and out == "" and doc["ok"] is False and doc["error"]["code"] == "bad_input"
