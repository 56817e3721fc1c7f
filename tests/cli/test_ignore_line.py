"""The ignore line (issue 33 polish): a compressed-tensors export of SmolLM2 printed its 211
ignored modules on one stderr line, under --json too. Text mode: the count and the first few
(every name when there are few); --json: nothing on stderr, the document's `ignore` has them all."""

from __future__ import annotations

import json
from pathlib import Path

from qtool.report.console import IGNORE_SHOWN
from tests.conftest import Invoke

ARGS = ["--format", "compressed-tensors", "--dry-run", "--exclude", "*proj*"]


def test_many_ignored_modules_are_summarised_in_text_and_silent_under_json(
    invoke: Invoke, samples: Path
) -> None:
    model, out = str(samples / "tiny-llama"), str(samples / "out")
    code, stdout, err = invoke("quantize", model, *ARGS, "--json", "-o", out)
    ignored = json.loads(stdout)["ignore"]
    assert len(ignored) == 15 > IGNORE_SHOWN  # 14 projections and lm_head
    assert code == 0 and "ignore" not in err, err
    code, _, err = invoke("quantize", model, *ARGS, "-o", out)
    lines = [line for line in err.splitlines() if "kept in float" in line]
    assert code == 0 and len(lines) == 1, err
    assert "15 layers: " in lines[0] and "and 11 more (--json lists them all)" in lines[0]
    assert sum(name in lines[0] for name in ignored) == IGNORE_SHOWN
    assert not Path(out).exists()


def test_few_ignored_modules_are_all_named(invoke: Invoke, samples: Path) -> None:
    code, _, err = invoke("quantize", str(samples / "tiny-llama"), "--format",
                          "compressed-tensors", "--dry-run", "-o", str(samples / "o"))  # fmt: skip
    assert code == 0 and "qtool: ignore (Linear layers kept in float): lm_head\n" in err
