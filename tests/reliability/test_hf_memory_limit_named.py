"""quantize HF_DIR --format gguf under a memory limit (ulimit -v, a container's) too low for a
tensor: the read buffer's allocation (ENOMEM from its mmap) read "cannot read it: Cannot
allocate memory", a read error of an intact file with no remedy, and the cast's copy
(MemoryError) was an internal error. Both are one line naming the weights file and the
tensor, its size, and what to do (free memory or raise the limit), as the GGUF reader says
it, for a float output and a quantized one; a real read error (EIO) stays "cannot read it"."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Invoke
from tests.formats.gguf.hf_models import write_model
from tests.outputs import ERROR_LINE, leftovers

pytest.importorskip("transformers")


def _no_memory_to_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from qtool.io import readbuffer

    def grow(self: object, nbytes: int) -> None:  # mmap's ENOMEM under ulimit -v
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(readbuffer.ReadBuffer, "_grow", grow)


def _no_memory_to_cast(monkeypatch: pytest.MonkeyPatch) -> None:
    from qtool.formats.gguf import hf_export

    def cast(*args: object, **kwargs: object) -> object:  # numpy's MemoryError
        raise MemoryError

    monkeypatch.setattr(hf_export, "cast", cast)


@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
@pytest.mark.parametrize("where", [_no_memory_to_read, _no_memory_to_cast], ids=["read", "cast"])
def test_a_tensor_over_the_memory_limit_says_so(
    tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dtype: str,
    where: Callable[[pytest.MonkeyPatch], None],
) -> None:  # fmt: skip
    from qtool.formats.gguf import hf_vocab

    src = write_model(tmp_path / "m", "llama")
    monkeypatch.setattr(hf_vocab, "pre_tokenizer", lambda directory: "gpt-2")
    where(monkeypatch)
    out = tmp_path / "o.gguf"
    code, stdout, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", dtype,
                               "-o", str(out))  # fmt: skip
    assert code == 1 and stdout == "" and ERROR_LINE.match(err), err
    assert f"{src / 'model.safetensors'}: tensor '" in err, err
    assert "bytes does not fit in the memory qtool may use" in err, err
    assert "raise the limit" in err and "cannot read" not in err, err
    assert "internal error" not in err
    assert not out.exists() and leftovers(tmp_path) == []
