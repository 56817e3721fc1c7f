"""Reading GGUF files without a memory map: a file truncated or rewritten while open is an
error, never SIGBUS; headers of any size are read in growing prefixes, up to a limit; the
hostile corpus is refused the same whatever prefix the parser is first given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qtool.errors import InputError
from qtool.gguf_types import ValueType
from qtool.io import gguf_file
from qtool.io.gguf_file import GGUFFile
from qtool.io.gguf_header import GGUFHeaderError, NeedMore, parse_header
from qtool.io.gguf_layout import GGUFValue
from qtool.io.gguf_write import write_gguf
from tests.corpus_gguf import CASES, GGUFCase

VOCAB = GGUFValue(ValueType.ARRAY, tuple(f"token{i}" for i in range(3000)), ValueType.STRING)


def _file(path: Path, n: int = 1 << 16) -> Path:
    """A GGUF with a ~40 KB vocabulary and two F32 tensors (the second `n` floats)."""
    data = [np.arange(8, dtype=np.float32), np.arange(n, dtype=np.float32)]
    specs = [("a", "F32", [8]), ("b", "F32", [n])]
    write_gguf(path, {"tokenizer.ggml.tokens": VOCAB}, specs, data)
    return path


def test_a_file_truncated_while_open_is_an_error_not_sigbus(tmp_path: Path) -> None:
    path = _file(tmp_path / "m.gguf")
    with GGUFFile(path) as f:
        a, b = f.header.tensors
        os.truncate(path, f.header.data_start + b.offset + 100)
        assert f.tensor_bytes(a).view(np.float32).tolist() == list(range(8))
        with pytest.raises(InputError, match=r"changed while reading 'b' \(ended 262,044 bytes"):
            f.tensor_bytes(b)
        with pytest.raises(InputError, match="changed while qtool was reading it"):
            f.check_unchanged()


@pytest.mark.slow
def test_no_sigbus_in_a_child_process_either(tmp_path: Path) -> None:
    """What killed qtool with a mapping (exit 135): truncate, then touch every byte."""
    path = _file(tmp_path / "m.gguf")
    code = (
        "import os, sys\nfrom qtool.io.gguf_file import GGUFFile\nfrom qtool.errors import "
        "InputError\nf = GGUFFile(sys.argv[1])\nos.truncate(sys.argv[1], 4096)\ntry:\n"
        "    [f.tensor_bytes(t).sum() for t in f.header.tensors]\nexcept InputError as e:\n"
        "    print(e); sys.exit(1)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    run = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, env=env)
    assert run.returncode == 1, run.stderr
    assert b"changed while reading" in run.stdout


def test_a_file_rewritten_in_place_is_noticed(tmp_path: Path) -> None:
    path = _file(tmp_path / "m.gguf")
    with GGUFFile(path) as f:
        with open(path, "r+b") as w:
            w.seek(f.header.data_start)
            w.write(b"\xff" * 4)
        os.utime(path, ns=(1, 1))
        with pytest.raises(InputError, match="changed while qtool was reading it"):
            f.check_unchanged()


def test_tensors_read_are_read_only_and_outlive_the_file(tmp_path: Path) -> None:
    path = _file(tmp_path / "m.gguf")
    f = GGUFFile(path)
    arr = f.tensor_array(f.header.tensors[0])
    f.close()
    f.check_unchanged()  # closed: nothing to check
    assert arr.tolist() == list(range(8))
    with pytest.raises(ValueError, match="read-only"):
        arr[0] = 1


def test_read_into_fills_a_buffer_and_refuses_a_wrong_one(tmp_path: Path) -> None:
    with GGUFFile(_file(tmp_path / "m.gguf")) as f:
        info = f.header.tensors[0]
        out = np.zeros(32, dtype=np.uint8)
        f.read_into(info, out)
        assert out.view(np.float32).tolist() == list(range(8))
        with pytest.raises(ValueError, match="contiguous uint8 array of 32"):
            f.read_into(info, np.zeros(31, dtype=np.uint8))


def test_headers_past_the_first_read_are_read_in_growing_prefixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _file(tmp_path / "m.gguf")
    with GGUFFile(path) as whole:
        expected = whole.header
    monkeypatch.setattr(gguf_file, "FIRST_READ", 64)
    with GGUFFile(path) as f:
        assert f.header.tensors == expected.tensors
        assert f.header.metadata["tokenizer.ggml.tokens"].value == VOCAB.value
        assert f.header.data_start == expected.data_start


def test_a_header_over_the_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gguf_file, "FIRST_READ", 1024)
    monkeypatch.setattr(gguf_file, "MAX_HEADER_BYTES", 4096)
    with pytest.raises(InputError, match="GGUF header is over qtool's limit of 0 MiB"):
        GGUFFile(_file(tmp_path / "m.gguf"))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_hostile_corpus_is_refused_alike_from_any_prefix(case: GGUFCase) -> None:
    content = case.content
    with pytest.raises(GGUFHeaderError) as whole:
        parse_header(memoryview(content))
    for cut in (0, 3, 4, 24, len(content) // 2):
        try:
            parse_header(memoryview(content[:cut]), len(content))
        except NeedMore as more:
            assert cut < more.needed <= len(content)
        except GGUFHeaderError as err:
            assert str(err) == str(whole.value)
