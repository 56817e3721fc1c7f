"""qtool calibrate's provenance keys (qtool.datasets.sha256 / .tokens) are read by one rule
wherever an imatrix is read (formats/imatrix/provenance.py): quantize --imatrix and
calibrate --merge refuse the same malformed keys with one line naming the file. quantize
--imatrix read them by a second copy of the rule: a token count of 1.5 was an internal error
(int(str(1.5))), one of -5 was accepted and written into the output's provenance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qtool.formats.imatrix import write_imatrix
from qtool.formats.imatrix.provenance import SHA_KEY, TOKENS_KEY
from qtool.gguf_types import ValueType
from qtool.io.gguf_layout import GGUFValue
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats
from tests.conftest import SAMPLES, Invoke

TINY_LM = SAMPLES / "tiny-lm"
Q = "model.layers.0.self_attn.q_proj.weight"
BAD_TOKENS = {
    "float": GGUFValue(ValueType.ARRAY, np.array([1.5], np.float32), ValueType.FLOAT32),
    "negative": GGUFValue(ValueType.ARRAY, np.array([-5], np.int64), ValueType.INT64),
    "two-for-one": GGUFValue(ValueType.ARRAY, np.array([1, 2], np.uint64), ValueType.UINT64),
}


def _imatrix(path: Path, tokens: GGUFValue | None) -> Path:
    stats = MatrixStats(np.ones((1, 64), np.float32), np.array([512], np.int64))
    extra = None
    if tokens is not None:
        extra = {SHA_KEY: GGUFValue(ValueType.ARRAY, ("a" * 64,), ValueType.STRING)}
        extra[TOKENS_KEY] = tokens
    write_imatrix(path, ImportanceMatrix({Q: stats}, 512, 1, ("c.txt",)), extra)
    return path


def _refused(code: int, out: str, err: str, path: Path) -> None:
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"qtool: error: {path}: ") and TOKENS_KEY in err, err
    assert "internal" not in err, err


@pytest.mark.parametrize("tokens", BAD_TOKENS.values(), ids=BAD_TOKENS.keys())
def test_quantize_imatrix_refuses_malformed_provenance(
    tmp_path: Path, invoke: Invoke, tokens: GGUFValue
) -> None:
    bad = _imatrix(tmp_path / "bad.imatrix.gguf", tokens)
    code, out, err = invoke(
        "quantize", str(TINY_LM), "--dtype", "int4", "--range", "mse",
        "--imatrix", str(bad), "-o", str(tmp_path / "q"),
    )  # fmt: skip
    _refused(code, out, err, bad)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("tokens", BAD_TOKENS.values(), ids=BAD_TOKENS.keys())
def test_merge_refuses_the_same_malformed_provenance(
    tmp_path: Path, invoke: Invoke, tokens: GGUFValue
) -> None:
    good = _imatrix(tmp_path / "good.imatrix.gguf", None)
    bad = _imatrix(tmp_path / "bad.imatrix.gguf", tokens)
    out_path = tmp_path / "m.imatrix.gguf"
    code, out, err = invoke("calibrate", "--merge", str(good), str(bad), "-o", str(out_path))
    _refused(code, out, err, bad)
    assert not out_path.exists()


def test_well_formed_provenance_reaches_the_output(tmp_path: Path, invoke: Invoke) -> None:
    tokens = GGUFValue(ValueType.ARRAY, np.array([4096], np.uint64), ValueType.UINT64)
    imatrix = _imatrix(tmp_path / "ok.imatrix.gguf", tokens)
    code, out, err = invoke(
        "quantize", str(TINY_LM), "--dtype", "int4", "--range", "mse",
        "--imatrix", str(imatrix), "-o", str(tmp_path / "q"), "--json",
    )  # fmt: skip
    assert code == 0, err
    assert '"tokens": 4096' in out and '"a' in out
