"""quantize HF_DIR --format gguf writes a float copy of the checkpoint beside the output first;
a full disk or a file-size limit while writing it said "internal error: OSError: [Errno 27]
File too large". It is the output's problem, worded as every other write's ("cannot write: file
too large ..."), naming the output's folder; exit 1, nothing left behind."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.formats.gguf.hf_models import write_model

pytest.importorskip("transformers")

# the tiny tokenizer's pre-tokenizer taken as gpt-2's (the converter's table lacks it)
RUN = (
    "import sys; from qtool.formats.gguf import hf_vocab; "
    "hf_vocab.pre_tokenizer = lambda directory: 'gpt-2'; "
    "from qtool.cli import main; sys.argv[0] = 'qtool'; main()"
)


def _limit_file_size(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_file_size_limit_on_the_float_copy_names_the_output_folder(tmp_path: Path) -> None:
    src = write_model(tmp_path / "m", "llama")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", RUN, "quantize", str(src), "--format", "gguf",
         "--dtype", "Q8_0", "-o", str(out_dir / "o.gguf")],
        capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: _limit_file_size(100_000),  # the F16 copy is ~200 KB
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == "" and "internal error" not in proc.stderr
    assert proc.stderr.startswith(f"qtool: error: {out_dir}: "), proc.stderr
    assert "cannot write: file too large" in proc.stderr
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
def test_file_size_limit_on_the_plan_names_the_limit(tmp_path: Path, dtype: str) -> None:
    """A dry run (and a float type's real run) builds the float GGUF's header in a memory file
    sized as the whole file, which a ulimit -f stops too: the error said "planning in memory:
    cannot write: file too large ...; write elsewhere with -o", which no -o changes."""
    src = write_model(tmp_path / "m", "llama")
    proc = subprocess.run(
        [sys.executable, "-c", RUN, "quantize", str(src), "--format", "gguf",
         "--dtype", dtype, "--dry-run", "-o", str(tmp_path / "o.gguf")],
        capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: _limit_file_size(100_000),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == "" and "internal error" not in proc.stderr
    assert "file-size limit (100,000 bytes, ulimit -f)" in proc.stderr, proc.stderr
    assert "with -o" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def _limit_open_files(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def test_no_descriptor_left_for_the_private_copy_is_one_line(tmp_path: Path) -> None:
    """The private copy of HF_DIR (every side file copied, every weight file held open) could
    fail with an OSError of its own (no descriptor, no space or inodes in TMPDIR): it was
    'internal error: OSError: [Errno 24] Too many open files'. One line naming where and what
    to do, exit 1, nothing written."""
    src = write_model(tmp_path / "m", "llama")
    for i in range(40):  # weight files are held open while the conversion runs
        (src / f"extra-{i}.safetensors").write_bytes(b"")
    out = tmp_path / "o.gguf"
    proc = subprocess.run(
        [sys.executable, "-c", RUN, "quantize", str(src), "--format", "gguf",
         "--dtype", "F16", "-o", str(out)],
        capture_output=True, text=True, timeout=300, preexec_fn=lambda: _limit_open_files(40),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "private copy of the model" in lines[0], proc.stderr
    assert "ulimit -n" in lines[0]
    assert not out.exists()
