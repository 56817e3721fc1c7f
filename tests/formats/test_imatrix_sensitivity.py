"""formats/imatrix/sensitivity.py: calibrate --sensitivity's alpha per weight, as metadata keys
of the imatrix GGUF: read back as written; any malformed set refused naming the file (never
half read); calibrate --merge takes the token-weighted mean when every input has them for the
same weights and reference, and refuses a mix (a merged file must not claim a measurement that
part of its statistics lacks)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qtool.errors import InputError
from qtool.formats.imatrix import read_imatrix_file, write_imatrix
from qtool.formats.imatrix.sensitivity import (
    ALPHA_KEY,
    KEYS,
    NAMES_KEY,
    TOKENS_KEY,
    Sensitivities,
    read_sensitivities,
    sensitivities,
    sensitivity_keys,
)
from qtool.gguf_types import ValueType
from qtool.io.gguf_layout import GGUFValue
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats
from tests.conftest import run_qtool

NAMES = ("blk.0.attn_q.weight", "blk.0.ffn_down.weight")


def _imatrix() -> ImportanceMatrix:
    stats = {n: MatrixStats(np.ones((1, 4), np.float32), np.array([8], np.int64)) for n in NAMES}
    return ImportanceMatrix(stats, 8, 1, ("t.txt",))


def _write(path: Path, sens: Sensitivities | None, **extra: GGUFValue) -> Path:
    keys = sensitivity_keys(sens) if sens is not None else {}
    write_imatrix(path, _imatrix(), keys | extra)
    return path


def test_alphas_read_back_as_written(tmp_path: Path) -> None:
    sens = Sensitivities({NAMES[1]: 0.25, NAMES[0]: 3.5e-7}, "rtn int4 g32", 512)
    f = read_imatrix_file(_write(tmp_path / "a.gguf", sens))
    assert read_sensitivities(tmp_path / "a.gguf", f.metadata) == sens
    assert sensitivities(f.metadata) == dict(sens.alpha)
    plain = read_imatrix_file(_write(tmp_path / "b.gguf", None))
    assert read_sensitivities(tmp_path / "b.gguf", plain.metadata) is None


def _floats(values: list[float]) -> GGUFValue:
    return GGUFValue(ValueType.ARRAY, np.array(values, np.float64), ValueType.FLOAT64)


@pytest.mark.parametrize(
    "change",
    [
        {ALPHA_KEY: _floats([1.0, float("nan")])},  # not finite
        {ALPHA_KEY: _floats([1.0, -0.5])},  # negative
        {ALPHA_KEY: _floats([1.0])},  # one alpha short
        {NAMES_KEY: GGUFValue(ValueType.ARRAY, (NAMES[0], NAMES[0]), ValueType.STRING)},
        {TOKENS_KEY: GGUFValue(ValueType.UINT64, 0)},
        {TOKENS_KEY: GGUFValue(ValueType.STRING, "512")},
    ],
)
def test_malformed_alphas_are_refused_naming_the_file(
    tmp_path: Path, change: dict[str, GGUFValue]
) -> None:
    keys = sensitivity_keys(Sensitivities(dict.fromkeys(NAMES, 1.0), "ref", 512)) | change
    path = tmp_path / "bad.gguf"
    write_imatrix(path, _imatrix(), keys)
    metadata = read_imatrix_file(path).metadata
    with pytest.raises(InputError) as err:
        read_sensitivities(path, metadata)
    assert err.value.path == str(path) and "qtool.sensitivity" in err.value.message
    with pytest.raises(ValueError):
        sensitivities(metadata)


@pytest.mark.parametrize("missing", KEYS)
def test_a_partial_set_of_keys_is_refused(tmp_path: Path, missing: str) -> None:
    keys = sensitivity_keys(Sensitivities(dict.fromkeys(NAMES, 1.0), "ref", 512))
    del keys[missing]
    path = tmp_path / "partial.gguf"
    write_imatrix(path, _imatrix(), keys)
    with pytest.raises(InputError):
        read_sensitivities(path, read_imatrix_file(path).metadata)


def test_a_merge_weighs_each_files_alpha_by_its_tokens(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.gguf", Sensitivities({NAMES[0]: 1.0, NAMES[1]: 4.0}, "ref", 100))
    b = _write(tmp_path / "b.gguf", Sensitivities({NAMES[0]: 3.0, NAMES[1]: 1.0}, "ref", 300))
    out = tmp_path / "ab.gguf"
    code, _, err = run_qtool("calibrate", "--merge", str(a), str(b), "-o", str(out))
    assert code == 0, err
    got = read_sensitivities(out, read_imatrix_file(out).metadata)
    assert got is not None and (got.reference, got.tokens) == ("ref", 400)
    assert got.alpha == pytest.approx({NAMES[0]: 2.5, NAMES[1]: 1.75}, rel=1e-15)


@pytest.mark.parametrize("other", ["none", "names", "reference"])
def test_a_merge_of_unlike_files_is_refused_in_one_line(tmp_path: Path, other: str) -> None:
    a = _write(tmp_path / "a.gguf", Sensitivities(dict.fromkeys(NAMES, 1.0), "ref", 100))
    unlike = {
        "none": None,
        "names": Sensitivities({NAMES[0]: 1.0}, "ref", 100),
        "reference": Sensitivities(dict.fromkeys(NAMES, 1.0), "other", 100),
    }[other]
    b = _write(tmp_path / "b.gguf", unlike)
    out = tmp_path / "ab.gguf"
    code, stdout, stderr = run_qtool("calibrate", "--merge", str(a), str(b), "-o", str(out))
    assert code == 1 and stdout == "" and not out.exists()
    assert len(stderr.strip().splitlines()) == 1 and str(b) in stderr, stderr
    code, stdout, stderr = run_qtool("calibrate", "--merge", str(a), str(b), "-o", str(out),
                                     "--json")  # fmt: skip
    assert code == 1 and stdout == "" and json.loads(stderr)["ok"] is False


def test_the_joint_fit_is_read_back_and_a_malformed_one_refused(tmp_path: Path) -> None:
    """qtool.sensitivity.joint (gain, saturation, additivity) round-trips and drives
    predicted / sum_within (inverse of each other); absent, predicted KL is the sum itself;
    a wrong length, a non-finite value or a gain <= 0 is refused naming the file."""
    from qtool.formats.imatrix.sensitivity import JOINT_KEY

    alpha = {NAMES[0]: 0.5, NAMES[1]: 2.0}
    fit = Sensitivities(alpha, "ref", 64, (0.7, 0.4, 0.8))
    got = read_sensitivities(tmp_path, read_imatrix_file(_write(tmp_path / "a.gguf", fit)).metadata)
    assert got == fit and got.predicted(1.0) == pytest.approx(0.7 / 1.4)
    assert got.sum_within(got.predicted(0.3)) == pytest.approx(0.3)
    plain = Sensitivities(alpha, "ref", 64)
    assert plain.predicted(0.3) == plain.sum_within(0.3) == 0.3
    for bad in ([0.7, 0.4], [0.7, float("nan"), 1.0], [0.0, 0.4, 1.0]):
        value = GGUFValue(ValueType.ARRAY, np.array(bad, np.float64), ValueType.FLOAT64)
        path = _write(tmp_path / f"bad{len(bad)}{bad[0]}.gguf", plain, **{JOINT_KEY: value})
        with pytest.raises(InputError, match=str(path)):
            read_sensitivities(path, read_imatrix_file(path).metadata)
