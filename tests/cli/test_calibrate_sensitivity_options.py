"""calibrate's --sensitivity-tokens: a usage error without --sensitivity (it was silently
ignored, as --max-kl-ratio without --method is not); more than the calibration tokens is
measured on those and a warning says it was capped; the console counts the tensors measured,
the embedding and head among them, as tensors, not Linears."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_qtool

CTX = 32
TEXT = " ".join(f"alpha {i} beta {i * 7 % 13} gamma." for i in range(120))


def test_sensitivity_tokens_without_sensitivity_is_a_usage_error(tmp_path: Path) -> None:
    out = tmp_path / "x.gguf"
    code, stdout, err = run_qtool("calibrate", str(tmp_path / "none"), "-o", str(out),
                                  "--sensitivity-tokens", "64")  # fmt: skip
    assert (code, stdout) == (2, ""), err
    assert "--sensitivity-tokens: goes only with --sensitivity" in " ".join(err.split())
    assert not out.exists()


def test_more_sensitivity_tokens_than_calibration_tokens_are_capped_and_said(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from tests.eval_models import build

    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    model = build(tmp_path / "llama", "llama-tied")
    args = ["calibrate", str(model), "-o", str(tmp_path / "x.gguf"), "--text", str(text),
            "--tokens", str(2 * CTX), "--ctx", str(CTX), "--sensitivity",
            "--sensitivity-tokens", str(8 * CTX), "--threads", "1"]  # fmt: skip
    code, stdout, err = run_qtool(*args)
    assert code == 0, err
    warned = " ".join(err.split())
    assert f"--sensitivity-tokens {8 * CTX} is more than the {2 * CTX} calibration tokens" in warned
    assert f"measured on {2 * CTX} (capped" in warned
    said = " ".join(stdout.split())
    code, js, err = run_qtool(*args, "--json", "--force")
    assert code == 0, err
    measured = json.loads(js)["sensitivity"]
    names = [x["name"] for x in measured["linears"]]
    assert "token_embd.weight" in names  # the embedding is measured: not a Linear
    assert f"sensitivity of {len(names)} tensors " in said and "Linears (" not in said
