"""A SIGTERM or SIGINT that arrives while qtool imports a module (torch's C initialisation, a
lazily loaded layer on its first use) is delivered once that import is done (cli/deferred.py):
the run stops with its one line and exit 143/130, and writes nothing. Raised inside the
import, the handler's exception was swallowed by torch's initialisation (the run went on and
exited 0) or left the lazily loaded report module half executed (a traceback instead of the
line). The signal is sent by the test's own import hook, at the moment the named module is
looked up, so the test lands inside the import every time."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qtool import api

_HOOK = """
import importlib.abc, os, signal, sys

MODULE, SIGNAL = sys.argv[1], getattr(signal, sys.argv[2])

class SignalOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == MODULE:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), SIGNAL)
        return None

sys.meta_path.insert(0, SignalOnImport())
sys.argv = ["qtool", *sys.argv[3:]]
from qtool.cli import main
main()
"""


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("q")
    save_file({"w": torch.randn(64, 64)}, d / "m.safetensors")
    api.quantize(d / "m.safetensors", d / "q.safetensors", api.QuantizeOptions(), device="cpu")
    return d / "q.safetensors"


@pytest.mark.parametrize(
    ("module", "name", "code", "what"),
    [
        ("qtool.report.layout", "SIGTERM", 143, "terminated"),  # the lazy report's first use
        ("qtool.report.layout", "SIGINT", 130, "interrupted"),
        ("torch._C", "SIGTERM", 143, "terminated"),  # torch's C initialisation
    ],
)
def test_a_signal_during_an_import_stops_the_run_with_its_line(
    quantized: Path, tmp_path: Path, module: str, name: str, code: int, what: str
) -> None:
    out = tmp_path / "d.safetensors"
    args = [module, name, "dequantize", str(quantized), "-o", str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", _HOOK, *args],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler),
    )
    assert (proc.returncode, proc.stdout) == (code, ""), proc.stderr
    assert proc.stderr == f"qtool: error: {what}; no output was written\n"
    assert not out.exists() and list(tmp_path.iterdir()) == []
