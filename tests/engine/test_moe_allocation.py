"""quantize --target-size/--target-bpw/--target-kl with an imatrix holding sensitivities on a
mixture-of-experts checkpoint: calibrate --sensitivity measures alpha for attention, the
embedding and the head, none for an expert or a router, so an allocation would keep every
one float (most of the model left out of the budget). The target is refused naming the reason
and what to give instead; the same imatrix without sensitivities allocates the experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tests.conftest import Invoke  # noqa: E402
from tests.moe_models import ORACLE_TEXT, build_moe  # noqa: E402

EXPERT = "model.layers.0.block_sparse_moe.experts.0.w1.weight"


def _calibrate(invoke: Invoke, model: Path, out: Path, *extra: str) -> None:
    (model.parent / "t.txt").write_text(ORACLE_TEXT)
    code, _, err = invoke("calibrate", str(model), "--text", str(model.parent / "t.txt"),
                          "--tokens", "128", "--ctx", "32", "--threads", "1", "-o", str(out),
                          *extra)  # fmt: skip
    assert code == 0, err


@pytest.mark.parametrize("target", [("--target-bpw", "14.5"), ("--target-kl", "0.01")])
def test_sensitivities_measured_for_no_expert_refuse_a_target(
    invoke: Invoke, tmp_path: Path, target: tuple[str, str]
) -> None:
    model = build_moe(tmp_path / "mixtral", "mixtral")
    imatrix = tmp_path / "s.imatrix.gguf"
    _calibrate(invoke, model, imatrix, "--sensitivity", "--sensitivity-tokens", "64")
    code, out, err = invoke("quantize", str(model), "--imatrix", str(imatrix), *target,
                            "--threads", "1", "-o", str(tmp_path / "o"))  # fmt: skip
    said = " ".join(err.split())
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "measured for no expert" in said and EXPERT in said and "s.imatrix.gguf" in said
    assert "calibrate without --sensitivity" in said
    assert not (tmp_path / "o").exists()


def test_an_imatrix_without_sensitivities_allocates_the_experts(
    invoke: Invoke, tmp_path: Path
) -> None:
    model = build_moe(tmp_path / "mixtral", "mixtral")
    imatrix = tmp_path / "h.imatrix.gguf"
    _calibrate(invoke, model, imatrix)
    code, out, err = invoke("quantize", str(model), "--imatrix", str(imatrix), "--target-bpw",
                            "6", "--threads", "1", "--json", "-o", str(tmp_path / "o"))  # fmt: skip
    assert code == 0, err
    rows = {t["name"]: t["decided_by"] for t in json.loads(out)["tensors"]}
    assert rows[EXPERT]["origin"] == "budget" and rows[EXPERT]["action"] == "quantize"
