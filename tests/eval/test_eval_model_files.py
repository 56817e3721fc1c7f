"""FLOAT's and QUANT's directories attacked as a hostile local user would: every file qtool or
transformers reads from them is checked first (regular files inside the directory, bounded
configs), so a FIFO never hangs the run and a link never leads outside; each problem is one
line naming the file, exit 1, stdout empty."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import SAMPLES, Invoke

pytest.importorskip("transformers")

LM = SAMPLES / "tiny-lm"


def _copy(tmp_path: Path, leave: tuple[str, ...] = ()) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    for f in LM.iterdir():
        if f.name not in leave:
            shutil.copy(f, model / f.name)
    return model


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _link_out(path: Path) -> None:
    secret = path.parent.parent / f"secret-{path.name}"
    shutil.copy(path, secret)
    path.unlink()
    path.symlink_to(secret)


@pytest.mark.parametrize(
    ("leave", "attack", "message"),
    [
        (("config.json",), None, "model: FLOAT must be a Hugging Face model directory "
         "(config.json beside safetensors weights); it has no config.json"),
        (("tokenizer.json",), None, "model: FLOAT has no tokenizer"),
        ((), ("tokenizer.json", _fifo), "tokenizer.json: not a regular file (a FIFO)"),
        ((), ("tokenizer_config.json", _fifo), "tokenizer_config.json: not a regular file"),
        ((), ("tokenizer.json", _link_out), "tokenizer.json: a symlink to"),
        ((), ("config.json", _fifo), "config.json"),
        ((), ("model.safetensors", _fifo), "model.safetensors"),
    ],
    ids=["no-config", "no-tokenizer", "fifo-tokenizer", "fifo-tokenizer-config",
         "tokenizer-link-out", "fifo-config", "fifo-weights"],
)  # fmt: skip
def test_float_directory_problems_are_one_line(
    invoke: Invoke,
    tmp_path: Path,
    leave: tuple[str, ...],
    attack: tuple[str, Callable[[Path], None]] | None,
    message: str,
) -> None:
    model = _copy(tmp_path, leave)
    if attack is not None:
        attack[1](model / attack[0])
    code, out, err = invoke("eval", str(model), str(LM), "--tokens", "20", "--threads", "1")
    assert code == 1 and out == "", err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_quant_tokenizer_fifo_is_refused(invoke: Invoke, tmp_path: Path) -> None:
    model = _copy(tmp_path)
    _fifo(model / "tokenizer.json")
    code, out, err = invoke("eval", str(LM), str(model), "--tokens", "20", "--threads", "1")
    assert code == 1 and out == "" and "tokenizer.json: not a regular file (a FIFO)" in err


def test_quant_of_another_model_is_one_line(invoke: Invoke) -> None:
    other = SAMPLES / "tiny-llama"
    code, out, err = invoke("eval", str(LM), str(other), "--tokens", "20", "--threads", "1")
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert "not FLOAT's architecture: its config.json differs in" in err


@pytest.fixture(scope="module")
def ct_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(FLOAT, its compressed-tensors int4 export), built once."""
    from qtool import api
    from qtool.spec import PerGroup, QSpec, StorageDtype
    from tests.eval_models import build

    root = tmp_path_factory.mktemp("ct")
    model = build(root / "llama", "llama")
    spec = QSpec(dtype=StorageDtype.INT4, granularity=PerGroup(32))
    options = api.QuantizeOptions(spec, format="compressed-tensors")
    api.quantize(model, root / "ct", options, device="cpu")
    return model, root / "ct"


@pytest.mark.parametrize("attack", [_fifo, _link_out], ids=["fifo", "link-out"])
def test_compressed_tensors_weights_are_checked_before_transformers_opens_them(
    invoke: Invoke, tmp_path: Path, ct_export: tuple[Path, Path], attack: Callable[[Path], None]
) -> None:
    model, ct = ct_export
    copy = tmp_path / "ct"
    shutil.copytree(ct, copy)
    attack(copy / "model.safetensors")
    code, out, err = invoke("eval", str(model), str(copy), "--tokens", "20", "--threads", "1")
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "model.safetensors" in err
