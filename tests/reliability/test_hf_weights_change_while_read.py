"""quantize HF_DIR --format gguf reads the checkpoint's weights with pread (io/checkpoint.py),
never through a mapping: a weights file truncated while the run reads it (another process
rewriting it, a network file system dropping pages) killed the run with SIGBUS under
safetensors' safe_open (exit -7, no message, the output's temporary file and the private copy
left behind). Now every way the file can change under the run is one line naming the file and
the tensor, exit 1, nothing at -o, nothing left beside it or in TMPDIR: shrunk after the
header check (each writing path: a float output, a quantized one through its float copy, a
dry run that reads the values), rewritten in place at the same size (torn values), and a
different header by the time the values are read (a tensor's shape changed, same bytes). A
read that fails (EIO) is the input's error, never "cannot write" the output.

Each test runs qtool in a subprocess whose hook changes the file at a fixed point (after the
first tensor is cast, or once the write is planned): a SIGBUS would kill pytest."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Invoke
from tests.formats.gguf.hf_models import write_model
from tests.outputs import ERROR_LINE, leftovers

pytest.importorskip("transformers")

# argv: the change ("shrink", "rewrite" or "reshape"), the weights file, then qtool's argv.
CHILD = r"""
import os, sys
from qtool.formats.gguf import hf_export, hf_vocab

class Table(dict):  # the tiny tokenizer's pre-tokenizer taken as "gpt-2" (test_hf_export's)
    def get(self, key, default=None):
        return super().get(key, "gpt-2")

hf_vocab.PRE_TOKENIZERS = Table(hf_vocab.PRE_TOKENIZERS)
change, weights = sys.argv[1], sys.argv[2]
done = []

def shrink():  # to its header: every tensor's data gone, the header as checked
    from qtool.io.stformat import read_header
    os.truncate(weights, read_header(weights).data_start)

def rewrite():  # the same size, the values zeroed in place: what was read is torn
    from qtool.io.stformat import read_header
    start, size = read_header(weights).data_start, os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.seek(start)
        f.write(bytes(size - start))

def reshape():  # a valid file of the same bytes in which one weight has another shape
    from safetensors.torch import load_file, save
    state = load_file(weights)
    name = "model.layers.0.mlp.down_proj.weight"
    state[name] = state[name].reshape(state[name].shape[::-1]).contiguous()
    with open(weights, "r+b") as f:  # in place: the run holds the file open
        f.write(save(state, {"format": "pt"}))
        f.truncate()

def after(name, what):
    real = getattr(hf_export, name)
    def hooked(*args, **kwargs):
        result = real(*args, **kwargs)
        if not done:
            done.append(what())
        return result
    setattr(hf_export, name, hooked)

if change == "reshape":  # once the write is planned (a float output plans twice)
    after("GGUFStreamWriter", reshape)
else:
    after("tensor_data", shrink if change == "shrink" else rewrite)
from qtool.cli import main
sys.argv = ["qtool", *sys.argv[3:]]
main()
"""


def _run(tmp_path: Path, change: str, *args: str) -> tuple[Path, str]:
    """A tiny llama in tmp_path/m converted with `args` while its weights change; asserts the
    one-line refusal with nothing left, and returns the model and the error line."""
    src = write_model(tmp_path / "m", "llama")
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    scratch.mkdir()
    weights = src / "model.safetensors"
    cmd = [sys.executable, "-c", CHILD, change, str(weights), "quantize", str(src),
           "--format", "gguf", *args, "-o", str(out / "m.gguf")]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(scratch)}
    proc = subprocess.run(cmd, capture_output=True, env=env, timeout=600, check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 1, (proc.returncode, err)  # -7: SIGBUS
    assert proc.stdout == b"" and ERROR_LINE.match(err), err
    assert list(out.iterdir()) == [] and leftovers(out) == []  # no output, no scratch copy
    assert list(scratch.iterdir()) == []  # the private copy of the model removed
    assert str(weights) in err, err  # the user's file, not the private copy's link
    return src, err


TENSOR = re.compile(r"tensor '[\w.]+'")


@pytest.mark.slow  # spawns a qtool process
@pytest.mark.parametrize(
    "args",
    [("--dtype", "F16"), ("--dtype", "Q8_0"), ("--dtype", "F16", "--dry-run", "--estimate")],
    ids=["float", "quantized", "estimate"],
)
def test_weights_shrunk_while_read(tmp_path: Path, args: tuple[str, ...]) -> None:
    """Shrunk to its header after the first tensor was cast: the next read is short."""
    _, err = _run(tmp_path, "shrink", *args)
    assert "changed while reading" in err and "bytes early" in err, err
    assert TENSOR.search(err), err


@pytest.mark.slow  # spawns a qtool process
def test_weights_rewritten_in_place_while_read(tmp_path: Path) -> None:
    """The same size, new values: the reads are whole but may mix old and new values, so the
    file's change (size and mtime of the descriptor read) refuses the output."""
    _, err = _run(tmp_path, "rewrite", "--dtype", "F16")
    assert "changed while qtool was reading it" in err, err


@pytest.mark.slow  # spawns a qtool process
def test_header_changed_before_values_read(tmp_path: Path) -> None:
    """A tensor whose shape is not the one the plan checked when its values are read: the
    values are not written under the planned shape (its bytes would fit)."""
    _, err = _run(tmp_path, "reshape", "--dtype", "F16")
    assert "changed while reading" in err, err
    assert "model.layers.0.mlp.down_proj.weight" in err, err


def test_read_error_names_the_input(
    tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO reading a weight (a failing disk, a network file system): one line naming the
    weights file and the tensor; the export's `except OSError` around its loop must not call
    it a write error of the output."""
    from qtool.formats.gguf import hf_vocab

    src = write_model(tmp_path / "m", "llama")
    monkeypatch.setattr(hf_vocab, "pre_tokenizer", lambda directory: "gpt-2")

    def failing(*args: object) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "preadv", failing)
    out = tmp_path / "m.gguf"
    code, stdout, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "F16",
                               "-o", str(out))  # fmt: skip
    assert code == 1 and stdout == "" and ERROR_LINE.match(err), err
    assert str(src / "model.safetensors") in err and "Input/output error" in err, err
    assert TENSOR.search(err) and "cannot write" not in err, err
    assert not out.exists() and leftovers(tmp_path) == []


def _append(weights: Path) -> None:
    with open(weights, "ab") as f:
        f.write(b"XXXXXXXX")


def _scribble(weights: Path) -> None:  # the same size, the header's length field overwritten
    with open(weights, "r+b") as f:
        f.write(b"\xff" * 8)


@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
@pytest.mark.parametrize(
    ("change", "said"),
    [(_append, "its size went from "), (_scribble, "(rewritten)")],
    ids=["appended", "rewritten"],
)
def test_weights_changed_before_the_header_is_read(
    tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dtype: str,
    change: Callable[[Path], None], said: str,
) -> None:  # fmt: skip
    """Appended to (or rewritten) after qtool opened it, before its header was parsed: the
    header no longer fits the file ("8 trailing bytes not covered by the header", "not a valid
    safetensors file"), which blamed an input that was valid when the run began. Said to have
    changed while read, naming the user's file."""
    from qtool.formats.gguf import hf_export, hf_vocab

    src = write_model(tmp_path / "m", "llama")
    monkeypatch.setattr(hf_vocab, "pre_tokenizer", lambda directory: "gpt-2")
    weights = src / "model.safetensors"
    read_config = hf_export.read_config

    def changing(directory: Path) -> object:
        change(weights)
        return read_config(directory)

    monkeypatch.setattr(hf_export, "read_config", changing)
    out = tmp_path / "m.gguf"
    code, stdout, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", dtype,
                               "-o", str(out))  # fmt: skip
    assert code == 1 and stdout == "" and ERROR_LINE.match(err), err
    assert f"{weights}: changed while qtool was reading it" in err and said in err, err
    assert "run again" in err and "not a valid" not in err, err
    assert not out.exists() and leftovers(tmp_path) == []


def test_weights_invalid_from_the_start_are_not_said_to_change(
    tmp_path: Path, invoke: Invoke
) -> None:
    """The same trailing bytes before the run began: the file is what is wrong."""
    src = write_model(tmp_path / "m", "llama")
    _append(src / "model.safetensors")
    code, _, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "Q8_0",
                          "-o", str(tmp_path / "m.gguf"))  # fmt: skip
    assert code == 1 and "trailing bytes not covered by the header" in err, err
    assert "changed while" not in err, err


@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
def test_private_copy_removed_under_the_run_is_not_the_inputs_fault(
    tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """The private copy in TMPDIR removed while the run reads it (a cleaner of that
    directory): it read 'm: no tokenizer.json or tokenizer.model' or a missing config.json,
    blaming an intact model directory. Said to have vanished, naming TMPDIR."""
    import shutil

    from qtool.formats.gguf import hf_export

    src = write_model(tmp_path / "m", "llama")
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR read again
    read_config = hf_export.read_config

    def removing(directory: Path) -> object:
        shutil.rmtree(directory.parent)  # the run's whole private directory
        return read_config(directory)

    monkeypatch.setattr(hf_export, "read_config", removing)
    out = tmp_path / "m.gguf"
    code, stdout, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", dtype,
                               "-o", str(out))  # fmt: skip
    assert code == 1 and stdout == "" and ERROR_LINE.match(err), err
    assert f"private copy of the model in {private} vanished" in err, err
    assert str(src) not in err and "internal error" not in err, err
    assert not out.exists() and leftovers(tmp_path) == []
