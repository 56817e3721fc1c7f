"""Start-up: what each command line imports (issue 12). Not timed (speed is in scripts/bench.py):
a command must not load what it does not use. torch only when tensors are touched; Rich, the
engine and pydantic (which Typer loads to convert option values) not for `--help`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytestmark = pytest.mark.slow  # every test starts a fresh interpreter

PROBE = """
import json, sys
from qtool.cli import main
code = None
try:
    main(json.loads(sys.argv[1]))  # with its arguments: returns (SystemExit), no os._exit
except SystemExit as exit:
    code = exit.code
loaded = [m for m in ("torch", "rich", "pydantic", "qtool.engine") if m in sys.modules]
sys.stderr.write("\\nLOADED " + json.dumps({"code": code, "loaded": loaded}) + "\\n")
"""


def loaded_by(*args: str) -> tuple[int, list[str]]:
    """(exit code, which of torch/rich/pydantic/qtool.engine) a fresh `qtool ARGS` imported."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True
    )
    last = result.stderr.rsplit("LOADED ", 1)[-1]
    doc = json.loads(last)
    return doc["code"], doc["loaded"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("startup") / "m.safetensors"
    save_file({"fc.weight": torch.randn(8, 4), "fc.bias": torch.zeros(8)}, path)
    return path


@pytest.mark.parametrize("args", [("--help",), ()], ids=["help", "no-args"])
def test_help_loads_neither_torch_nor_rich_nor_the_engine(args: tuple[str, ...]) -> None:
    code, loaded = loaded_by(*args)
    assert code in (0, 2) and loaded == [], loaded


def test_command_help_loads_neither_torch_nor_rich_nor_the_engine() -> None:
    code, loaded = loaded_by("quantize", "--help")  # Typer converts values with pydantic
    assert code == 0 and loaded == ["pydantic"], loaded


def test_usage_error_loads_no_torch(checkpoint: Path) -> None:
    code, loaded = loaded_by("quantize", str(checkpoint), "--scheme", "bogus")
    assert code == 2 and "torch" not in loaded and "qtool.engine" not in loaded


@pytest.mark.parametrize(
    "args",
    [("inspect",), ("inspect", "--json"), ("quantize", "--dry-run"), ("quantize", "--dry-run",
     "--json")],
    ids=["inspect", "inspect-json", "dry-run", "dry-run-json"],
)  # fmt: skip
def test_header_only_commands_load_no_torch(checkpoint: Path, args: tuple[str, ...]) -> None:
    code, loaded = loaded_by(args[0], str(checkpoint), *args[1:])
    assert code == 0 and "torch" not in loaded, loaded


def test_inspect_of_a_quantized_file_loads_no_torch(checkpoint: Path) -> None:
    from typer.testing import CliRunner

    from qtool.cli import app

    out = checkpoint.with_name("m.int8.safetensors")
    assert CliRunner().invoke(app, ["quantize", str(checkpoint), "-o", str(out)]).exit_code == 0
    for target in (out, out.with_name("m.int8.qparams.safetensors")):
        code, loaded = loaded_by("inspect", str(target))
        assert code == 0 and "torch" not in loaded, (target, loaded)
