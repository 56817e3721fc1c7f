"""quantize --imatrix opens the file once (it was opened by path five times: the read, the
hash, the datasets, two headers) and hashes the bytes that descriptor parsed, so the SHA-256
an output records describes the statistics used; a file that changes between the parse and the
hash is refused."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qtool.formats.imatrix as imatrix_format
from qtool.calibrate_results import DatasetInfo
from qtool.engine.importance import read_importance
from qtool.errors import InputError
from qtool.formats.imatrix.provenance import SHA_KEY, TOKENS_KEY
from qtool.gguf_types import ValueType
from qtool.io.gguf_layout import GGUFValue
from tests.reliability.test_imatrix_hostile import META, ONE, TAIL, dat, gguf_file, good


def _count_opens(monkeypatch: pytest.MonkeyPatch, path: Path) -> list[str]:
    opened: list[str] = []
    real = os.open

    def counting(p: Any, *args: Any, **kwargs: Any) -> int:
        if os.fspath(p) == os.fspath(path):
            opened.append(os.fspath(p))
        return real(p, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting)
    return opened


@pytest.mark.parametrize("kind", ["gguf", "dat"])
def test_the_imatrix_is_opened_once_and_hashed_as_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    if kind == "gguf":
        meta = {
            **META,
            SHA_KEY: GGUFValue(ValueType.ARRAY, ("a" * 64,), ValueType.STRING),
            TOKENS_KEY: GGUFValue(ValueType.ARRAY, np.array([9], np.uint64), ValueType.UINT64),
        }
        path = gguf_file(tmp_path / "m.gguf", good(), meta)
    else:
        path = tmp_path / "m.dat"
        path.write_bytes(dat([ONE], TAIL))
    opened = _count_opens(monkeypatch, path)
    _, provenance = read_importance(path)
    assert len(opened) == 1, opened
    assert provenance.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    if kind == "gguf":
        assert provenance.datasets == (DatasetInfo("t.txt", "a" * 64, 9),)


def test_a_file_changed_between_parse_and_hash_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = gguf_file(tmp_path / "m.gguf", good())
    from qtool.formats.imatrix.ggufimatrix import read_gguf_from as real

    def then_append(p: Path, file: Any) -> Any:
        out = real(p, file)
        with open(path, "ab") as f:
            f.write(b"\0" * 32)
        return out

    monkeypatch.setattr(imatrix_format, "read_gguf_from", then_append)
    with pytest.raises(InputError, match="changed while qtool was reading it"):
        read_importance(path)
