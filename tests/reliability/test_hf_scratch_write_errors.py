"""quantize HF_DIR --format gguf writes a float copy of the checkpoint beside the output first;
a full disk or a file-size limit while writing it said "internal error: OSError: [Errno 27]
File too large". It is the output's problem, worded as every other write's ("cannot write: file
too large ..."), naming the output's folder; exit 1, nothing left behind."""

from __future__ import annotations

import os
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


def _data_bytes(weights: Path) -> int:
    """A safetensors file's data: its size less its header."""
    with open(weights, "rb") as f:
        return weights.stat().st_size - 8 - int.from_bytes(f.read(8), "little")


@pytest.mark.parametrize("up_front", [True, False], ids=["under half the data", "just over"])
def test_file_size_limit_on_the_float_copy_names_the_output_folder(
    tmp_path: Path, up_front: bool
) -> None:
    """A limit under half the weights' data (the least an F16 copy of F32 weights holds) is
    refused before any work, as a float type's output is; one the copy passes only while
    written fails there. Both name the output's folder and the limit's cause."""
    src = write_model(tmp_path / "m", "llama")
    least = _data_bytes(src / "model.safetensors") // 2  # the F16 copy of the F32 weights
    limit = least - 1 if up_front else least + 1
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", RUN, "quantize", str(src), "--format", "gguf",
         "--dtype", "Q8_0", "-o", str(out_dir / "o.gguf")],
        capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: _limit_file_size(limit),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == "" and "internal error" not in proc.stderr
    assert proc.stderr.startswith(f"qtool: error: {out_dir}: "), proc.stderr
    if up_front:
        assert f"at least {least:,} bytes" in proc.stderr, proc.stderr
        assert f"file-size limit ({limit:,} bytes, ulimit -f)" in proc.stderr, proc.stderr
    else:
        assert "cannot write: file too large" in proc.stderr, proc.stderr
    assert list(out_dir.iterdir()) == []


def test_file_size_limit_on_the_private_copy_names_where_and_the_limit(tmp_path: Path) -> None:
    """The tokenizer files copied into TMPDIR over a ulimit -f: "cannot copy the model's
    tokenizer files to a private temporary directory: File too large" named neither the
    directory nor the limit."""
    src = write_model(tmp_path / "m", "llama")
    private = tmp_path / "tmp"
    private.mkdir()
    limit = 1000  # under tokenizer.json's size, over config.json's
    assert (src / "tokenizer.json").stat().st_size > limit
    proc = subprocess.run(
        [sys.executable, "-c", RUN, "quantize", str(src), "--format", "gguf",
         "--dtype", "F16", "-o", str(tmp_path / "o.gguf")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(private)},
        preexec_fn=lambda: _limit_file_size(limit),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"private copy of the model in {private}:" in proc.stderr, proc.stderr
    assert "file-size limit (1,000 bytes, ulimit -f); raise the limit" in proc.stderr
    assert list(private.iterdir()) == [] and not (tmp_path / "o.gguf").exists()


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
