"""A NaN/Inf weight under a calibrated method (--method gptq|awq) is what it is in a plain run:
refused before the model runs with the one-line error naming the file and the tensor, or, with
--keep-nonfinite, kept as it is and left out of the method's targets. Both methods rounded the
tensor themselves and ended in an internal error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import Invoke

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

TINY_LM = Path(__file__).parents[2] / "sample_weights" / "tiny-lm"
POISONED = "model.layers.1.mlp.down_proj.weight"  # the last Linear: nothing quantized after it
TEXT = " ".join(f"alpha {i} beta {i * 7 % 13} gamma." for i in range(80))


@pytest.fixture
def nan_lm(tmp_path: Path) -> Path:
    model = tmp_path / "nanlm"
    shutil.copytree(TINY_LM, model)
    tensors = load_file(model / "model.safetensors")
    tensors[POISONED] = tensors[POISONED].clone()
    tensors[POISONED][3, 5] = float("nan")
    tensors[POISONED][7, 1] = float("inf")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "calib.txt").write_text(TEXT)
    return model


def _run(model: Path, method: str, *more: str) -> list[str]:
    return ["quantize", str(model), "--method", method, "--text",
            str(model.parent / "calib.txt"), "--tokens", "256", "--ctx", "32", "--dtype", "int4",
            "--group-size", "16", "--threads", "1", "-o", str(model.parent / "out"),
            *more]  # fmt: skip


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_nonfinite_weight_is_refused_naming_file_and_tensor(
    nan_lm: Path, invoke: Invoke, method: str
) -> None:
    rc, stdout, err = invoke(*_run(nan_lm, method))
    assert (rc, stdout) == (1, ""), err
    line = err.strip()
    assert "\n" not in line and "internal error" not in line, err
    assert str(nan_lm / "model.safetensors") in line and POISONED in line, err
    assert "2 NaN/Inf values" in line, err
    assert not (nan_lm.parent / "out").exists()


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_keep_nonfinite_keeps_the_tensor_out_of_the_method(
    nan_lm: Path, invoke: Invoke, method: str
) -> None:
    rc, stdout, err = invoke(*_run(nan_lm, method, "--keep-nonfinite", "--json"))
    assert rc == 0, err
    doc = json.loads(stdout)
    rows = {t["name"]: t for t in doc["tensors"]}
    kept = rows[POISONED]["decided_by"]
    assert (kept["action"], kept["origin"], kept["nonfinite"]) == ("keep", "keep-nonfinite", 2)
    done = load_file(nan_lm.parent / "out" / "model.safetensors")
    assert int((~torch.isfinite(done[POISONED].float())).sum()) == 2
