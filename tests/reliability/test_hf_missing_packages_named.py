"""quantize HF_DIR --format gguf without a working gguf or tokenizers package stops before any
work, naming the package to install (docs/gguf.md's promise), on a run and a dry run: a gguf
found on the path but failing to import (a broken install) was "internal error", since only
its absence was looked for. Usage error, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.formats.gguf.hf_models import write_model

pytest.importorskip("transformers")


@pytest.mark.parametrize("dry", [[], ["--dry-run"]], ids=["run", "dry-run"])
@pytest.mark.parametrize("package", ["gguf", "tokenizers"])
def test_missing_package_is_named(tmp_path: Path, package: str, dry: list[str]) -> None:
    src = write_model(tmp_path / "m", "llama")
    shim = tmp_path / "shim" / package  # found on the path first, failing to import
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(f"raise ModuleNotFoundError('{package}', name='{package}')")
    env = {**os.environ, "PYTHONPATH": str(shim.parent)}
    out = tmp_path / "o.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "qtool", "quantize", str(src), "--format", "gguf",
         "--dtype", "Q8_0", "-o", str(out), *dry],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    code, stdout, err = done.returncode, done.stdout, done.stderr
    assert code == 2, err
    assert stdout == "" and "internal error" not in err and "Traceback" not in err
    assert f"needs the {package} package; install it with" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "shim"]
