"""An importance matrix that cannot be written (a full disk, a file-size limit: EFBIG as ENOSPC
reads the same) is one line naming the -o file and what to do, exit 1, stdout empty, no temp
file left, for every command that writes one: `calibrate -o` and `calibrate --merge` (dense
and MoE write through the same GGUF writer). It was an internal error, OSError from the writer,
wherever the file outgrew the write buffer (8 KiB) before the final flush, which was handled;
the tiny Mixtral's imatrix (12.7 kB) does."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tests.conftest import Invoke  # noqa: E402
from tests.moe_models import build_moe  # noqa: E402

LIMIT = 7000  # bytes: above the tiny Mixtral's tokenizer (6.2 kB, copied), below its imatrix


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def _qtool_limited(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qtool", *args], capture_output=True, text=True, timeout=300,
        preexec_fn=_limit_file_size,
    )  # fmt: skip


@pytest.mark.parametrize("how", ["calibrate", "merge"])
def test_an_imatrix_too_large_to_write_names_the_output(
    tmp_path: Path, invoke: Invoke, how: str
) -> None:
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    first = tmp_path / "a.imatrix.gguf"
    model = build_moe(tmp_path / "m", "mixtral")
    cal = ["calibrate", str(model), "--text", str(text), "--tokens", "64", "--ctx", "32"]
    code, _, err = invoke(*cal, "-o", str(first))
    assert code == 0 and first.stat().st_size > 8192, err
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "b.imatrix.gguf"
    if how == "calibrate":
        proc = _qtool_limited(*cal, "-o", str(out))
    else:
        second = tmp_path / "b.imatrix.gguf"
        second.write_bytes(first.read_bytes())
        proc = _qtool_limited("calibrate", "--merge", str(first), str(second), "-o", str(out))
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("qtool: warning")]
    assert len(errors) == 1 and "internal error" not in errors[0], proc.stderr  # merge: same text
    assert f"{out}: cannot write: file too large" in errors[0], proc.stderr
    assert list(out_dir.iterdir()) == []
