"""A torch pickle input (.pt, zip) is read into memory qtool owns, never mapped: torch.load ran
with mmap=True, the state dict's tensors stayed views of the mapped file, and a file truncated
while the run quantized them killed it with SIGBUS (exit -7, no message, the output's temporary
file left). Now the values already read stay whole, the change is seen when the run checks its
inputs (one line naming the file, exit 1) and nothing is left beside the output.

The run is a subprocess whose hook truncates the file once the first tensor was taken from the
checkpoint: a SIGBUS would kill pytest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.outputs import ERROR_LINE, leftovers

pytestmark = pytest.mark.slow  # spawns a qtool process

# argv: the .pt file, then qtool's argv.
CHILD = r"""
import os, sys
from qtool.io import checkpoint

real, done, pt = checkpoint.Checkpoint.rows, [], sys.argv[1]
def rows(self, *args, **kwargs):
    result = real(self, *args, **kwargs)
    if not done and str(self.path) == pt:
        done.append(os.truncate(self.path, os.path.getsize(self.path) // 2))
    return result
checkpoint.Checkpoint.rows = rows
from qtool.cli import main
sys.argv = ["qtool", *sys.argv[2:]]
main()
"""


def test_pickle_truncated_while_quantized(tmp_path: Path) -> None:
    src, out = tmp_path / "m.pt", tmp_path / "out"
    out.mkdir()
    gen = torch.Generator().manual_seed(0)
    torch.save({f"layer.{i}.weight": torch.randn(256, 256, generator=gen) for i in range(4)}, src)
    cmd = [sys.executable, "-c", CHILD, str(src), "quantize", str(src), "-o",
           str(out / "q.safetensors")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, timeout=600, check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 1, (proc.returncode, err)  # -7: SIGBUS
    assert proc.stdout == b"" and ERROR_LINE.match(err), err
    assert str(src) in err and "changed" in err, err
    assert list(out.iterdir()) == [] and leftovers(out) == []
