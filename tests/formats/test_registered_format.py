"""A format is one package plus its registration (issue 29): a format registered in the process
that runs the CLI, and named nowhere else, is a `--format` choice with its help line, writes
through the quantize loop with the base class's defaults, and its options are checked by the
registry's rules, not by branches on the built-in names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qtool.formats import builtins, detect

# A container that adds nothing new: qtool's files under another format name, registered with a
# help line; its OutputFormat overrides only the name (the rest: QtoolFormat's and the base's).
PROBE = """
import dataclasses, json, sys
from qtool.formats import registry
from qtool.formats.qtool.writer import QtoolFormat

class Copy(QtoolFormat):
    name = "qtool-copy"

qtool = registry.entry("qtool")
registry.register(dataclasses.replace(
    qtool, name="qtool-copy", output=Copy, belongings=None, groups="",
    help="qtool's files under another name."))
from qtool.cli import main
sys.argv = ["qtool", *json.loads(sys.argv[1])]
main()
"""


def qtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args)],
        capture_output=True,
        text=True,
    )


def test_a_registered_format_is_a_format_choice_with_its_help_line() -> None:
    result = qtool("quantize", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # the help as words, whatever the wrapping
    assert "--format qtool|compressed-tensors|gguf|qtool-copy" in text
    assert "llama.cpp loads. qtool-copy: qtool's files under another name." in text


def test_a_registered_format_writes_through_the_loop(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    save_file({"fc.weight": torch.randn(8, 32), "fc.bias": torch.zeros(8)}, src)
    out = tmp_path / "m.copy.safetensors"
    result = qtool("quantize", str(src), "--format", "qtool-copy", "-o", str(out), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["format"] == "qtool-copy" and doc["totals"]["quantized"] == 1
    assert out.exists() and str(out) in doc["outputs"]
    restored = tmp_path / "back.safetensors"
    back = qtool("dequantize", str(out), "-o", str(restored), "--json")
    assert back.returncode == 0, back.stderr


def test_a_registered_format_takes_no_config_it_does_not_read(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    save_file({"fc.weight": torch.randn(8, 32)}, src)
    result = qtool("quantize", str(src), "--format", "qtool-copy", "--config", str(src))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "qtool: error: --config: goes with --format compressed-tensors (the qtool-copy format "
        "reads no config.json)\n"
    )
    result = qtool("quantize", str(src), "--format", "qtool-copy", "--group-fallback", "keep")
    assert result.stderr == (
        "qtool: error: --group-fallback: goes with --format compressed-tensors\n"
    )


def test_detectors_run_in_the_order_of_the_one_priority_table() -> None:
    """Every built-in detector has its place in detect.PRIORITY and runs in that order; a
    detector with no place, or registered twice, is refused (no silent order)."""

    builtins.load()
    registered = [name for _, name, _ in detect._DETECTORS]
    assert registered == sorted(detect.PRIORITY, key=detect.PRIORITY.__getitem__)
    with pytest.raises(ValueError, match="has no priority"):
        detect.register("unplaced", lambda probe: None)
    with pytest.raises(ValueError, match="registered already"):
        detect.register("gguf", lambda probe: None)
    assert [name for _, name, _ in detect._DETECTORS] == registered
