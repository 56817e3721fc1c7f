"""`quantize X.gguf --allow-requantize` dequantizes the input into an F32 copy beside the output
before it quantizes that copy: every check the second run makes on its output (it exists
without --force, it is a FIFO or a directory, the free space for the copy and the output) is
made before the copy is written, so a refusal never waits for (or fills the disk with) the copy;
and an error writing the copy names the directory it was written in as qtool's temporary copy,
never the user's input (which is only read)."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from tests import gguf_models as M
from tests.conftest import Invoke

pytest.importorskip("gguf")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Q8_0 GGUF of the tiny llama, alone in its directory."""
    from qtool import api
    from qtool.spec import FormatName, gguf_spec

    d = M.make_hf_llama(tmp_path_factory.mktemp("tiny"))
    bf16 = M.write_float_gguf(d, d / "bf16.gguf", "BF16")
    out = tmp_path_factory.mktemp("q8") / "model.Q8_0.gguf"
    api.quantize(bf16, out, api.QuantizeOptions(gguf_spec("Q8_0"), format=FormatName.GGUF))
    return out


@pytest.fixture
def no_dequantize(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    return _no_dequantize(monkeypatch)


def _no_dequantize(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Records each dequantize the run starts (and starts none): a check made first leaves it
    empty."""
    from qtool.engine import restore

    started: list[Path] = []

    def record(src: Path, out: Path, **kwargs: object) -> None:
        started.append(out)
        raise AssertionError("dequantized before the output was checked")

    monkeypatch.setattr(restore, "dequantize", record)
    return started


def _requantize(invoke: Invoke, src: Path, out: Path, *args: str) -> tuple[int, str, str]:
    return invoke(
        "quantize", str(src), "--format", "gguf", "--dtype", "Q4_0", "--allow-requantize",
        "-o", str(out), *args,
    )  # fmt: skip


def _error(err: str) -> str:
    return [line for line in err.splitlines() if "error:" in line][-1]


def test_an_existing_output_is_refused_before_the_copy(
    invoke: Invoke, q8: Path, tmp_path: Path, no_dequantize: list[Path]
) -> None:
    taken = tmp_path / "taken.gguf"
    taken.write_bytes(b"mine")
    code, out, err = _requantize(invoke, q8, taken)
    assert (code, out, no_dequantize) == (1, "", []), err
    assert "already exists" in _error(err) and "--force" in _error(err)
    assert taken.read_bytes() == b"mine" and os.listdir(tmp_path) == ["taken.gguf"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_output_that_is_no_file_is_refused_before_the_copy_even_with_force(
    invoke: Invoke, q8: Path, tmp_path: Path, no_dequantize: list[Path], kind: str
) -> None:
    where = tmp_path / "w.gguf"
    if kind == "fifo":
        os.mkfifo(where)
    else:
        where.mkdir()
    code, out, err = _requantize(invoke, q8, where, "--force")
    assert (code, out, no_dequantize) == (1, "", []), err
    assert _error(err).startswith(f"qtool: error: {where}: is a ")
    assert os.listdir(tmp_path) == ["w.gguf"]


def test_free_space_for_the_f32_copy_and_the_output_is_checked_before_the_copy(
    invoke: Invoke,
    q8: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    copy = tmp_path / "copy.gguf"
    assert invoke("dequantize", str(q8), "-o", str(copy))[0] == 0
    size = copy.stat().st_size
    copy.unlink()
    # room for the F32 copy alone: the output finds none left after it
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(size * 9, size * 8, size))
    started = _no_dequantize(monkeypatch)
    code, out, err = _requantize(invoke, q8, tmp_path / "r.gguf")
    assert (code, out, started) == (1, "", []), err
    assert _error(err).startswith(f"qtool: error: {tmp_path / 'r.gguf'}: needs about ")
    assert os.listdir(tmp_path) == []


def _limit_file_size(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_full_disk_writing_the_copy_names_its_directory_not_the_input(
    q8: Path, tmp_path: Path
) -> None:
    """The copy is larger than the file-size limit (the input and the output smaller): the
    error is about writing, so it names where (qtool's temporary copy), not the input."""
    src = tmp_path / "in" / q8.name
    src.parent.mkdir()
    shutil.copyfile(q8, src)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = ["quantize", str(src), "--format", "gguf", "--dtype", "Q4_0", "--allow-requantize"]
    proc = subprocess.run(
        [sys.executable, "-m", "qtool", *args, "-o", str(out_dir / "r.gguf")],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: _limit_file_size(2 * src.stat().st_size),
    )
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
    error = _error(proc.stderr)
    assert error.startswith(f"qtool: error: {out_dir}: "), error
    assert "temporary F32 copy" in error and "cannot write" in error
    assert str(src) not in error
    assert os.listdir(out_dir) == [] and os.listdir(src.parent) == [src.name]
