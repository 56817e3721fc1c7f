"""The files a quantize run reads besides the checkpoint (the --imatrix, a method's --text and
--check-text) are inputs like the checkpoint: an output that is one of them (the same path, a
hard link, a symlink: compared by device and inode) is refused before anything is read or
written, with --force too, in a dry run too; the file is left byte for byte as it was."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from qtool.formats.imatrix import write_imatrix
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats
from tests.conftest import SAMPLES, Invoke
from tests.gguf_models import make_hf_llama, write_float_gguf

TINY_LM = SAMPLES / "tiny-lm"


def _imatrix(path: Path, width: int = 64) -> Path:
    stats = MatrixStats(np.ones((1, width), np.float32), np.array([10], np.int64))
    write_imatrix(path, ImportanceMatrix({"blk.0.attn_q.weight": stats}, 512, 1, ("c.txt",)))
    return path


def _same(p: Path) -> Path:
    return p


def _hard_link(p: Path) -> Path:
    os.link(p, p.with_name("link.gguf"))
    return p.with_name("link.gguf")


def _symlink(p: Path) -> Path:
    p.with_name("sym.gguf").symlink_to(p)
    return p.with_name("sym.gguf")


@pytest.mark.parametrize("alias", [_same, _hard_link, _symlink], ids=["same", "hard", "sym"])
@pytest.mark.parametrize("fmt", ["gguf"])
@pytest.mark.parametrize("dry", [False, True], ids=["write", "dry-run"])
def test_the_imatrix_is_never_an_output(
    tmp_path: Path, invoke: Invoke, alias: Callable[[Path], Path], fmt: str, dry: bool
) -> None:
    imatrix = _imatrix(tmp_path / "m.imatrix.gguf", 256 if fmt == "gguf" else 64)
    before = imatrix.read_bytes()
    out = alias(imatrix)
    dtype = ["--dtype", "Q4_0"] if fmt == "gguf" else ["--dtype", "int4", "--range", "mse"]
    model = TINY_LM
    if fmt == "gguf":
        model = write_float_gguf(make_hf_llama(tmp_path / "hf"), tmp_path / "f.gguf")
    code, stdout, err = invoke(
        "quantize", str(model), "--format", fmt, *dtype, "--imatrix", str(imatrix),
        "-o", str(out), "--force", *(["--dry-run"] if dry else []),
    )  # fmt: skip
    assert code == 1 and stdout == "", err
    assert f"would overwrite the input {imatrix}" in err and err.count("\n") == 1, err
    assert imatrix.read_bytes() == before


@pytest.mark.parametrize("flag", ["--text", "--check-text"])
def test_a_method_text_is_never_an_output(tmp_path: Path, invoke: Invoke, flag: str) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "out"  # a directory output replaced with --force, the text inside it
    out.mkdir()
    text = out / "t.txt"
    text.write_text("Some calibration text. " * 40)
    before = text.read_bytes()
    code, stdout, err = invoke(
        "quantize", str(TINY_LM), "--format", "qtool", "--dtype", "int4", "--method", "gptq",
        flag, str(text), "-o", str(out), "--force",
    )  # fmt: skip
    assert code == 1 and stdout == "", err
    assert str(text) in err, err
    assert text.read_bytes() == before
