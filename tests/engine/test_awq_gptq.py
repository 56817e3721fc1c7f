"""`quantize --method awq+gptq` (engine/methods/awq.py, then_gptq) on the tiny Llama built here:
GPTQ solves each Linear on AWQ's smoothed weights with the Hessian of the smoothed block's
inputs (not the unsmoothed ones: the float output energy tr(W H W^T) is the same as the plain
GPTQ run's for the same block inputs); its guard compares GPTQ with what the Linear gets
otherwise (AWQ's rounding of the smoothed weight, or round to nearest where no fold touched
it), so a GPTQ made to lose leaves exactly `--method awq`'s output; the notes say which
baseline each figure is against."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from qtool import api  # noqa: E402
from qtool.calibration import Calibration, Guard, Method  # noqa: E402
from qtool.engine.plan import QuantizeOptions  # noqa: E402
from qtool.numerics import gptq  # noqa: E402
from qtool.spec import PerGroup, QSpec, Scheme, StorageDtype  # noqa: E402
from tests.conftest import Invoke  # noqa: E402
from tests.engine.test_gptq_pass import _losing  # noqa: E402
from tests.eval_models import build  # noqa: E402

CTX = 32
TEXT = " ".join(f"alpha {i} beta {i * 7 % 13} gamma." for i in range(80))
CHECK = " ".join(f"Delta{i}: epsilon zeta eta {i % 5}!" for i in range(40))
SPEC = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(16))
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROWS_SCALED = ("v_proj", "up_proj")  # divided by the next group's scales


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("awq_gptq")
    (root / "calib.txt").write_text(TEXT)
    (root / "check.txt").write_text(CHECK)
    return build(root / "llama", "llama")


def _options(model: Path, method: Method, **calibration: Any) -> QuantizeOptions:
    root = model.parent
    data = Calibration(
        method, texts=(root / "calib.txt",), tokens=8 * CTX, ctx=CTX,
        check_texts=(root / "check.txt",),
    )  # fmt: skip
    return QuantizeOptions(SPEC, calibration=dataclasses.replace(data, **calibration))


def _quantize(model: Path, out: Path, options: QuantizeOptions) -> Any:
    return api.quantize(model, out, options, device="cpu", force=True)


def test_gptq_made_to_lose_leaves_the_awq_model(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard's baseline is AWQ's rounding of the SMOOTHED weight (what the Linear gets
    otherwise): with GPTQ made to lose everywhere, awq+gptq writes `--method awq`'s bytes, and
    each note gives GPTQ's loss against awq and against rounding of the original; under
    --guard none the loser is kept and labelled awq+gptq (the guard decided)."""
    awq_only = tmp_path / "awq"
    _quantize(model, awq_only, _options(model, Method.AWQ))
    monkeypatch.setattr(gptq, "gptq_quantize", _losing)
    out = tmp_path / "both"
    summary = _quantize(model, out, _options(model, Method.AWQ_GPTQ))
    linears = [r for r in summary.rows if r.quantized and ".layers." in r.name]
    assert len(linears) == 14
    assert {r.decided_by.method for r in linears} <= {"awq", "rtn"}
    scaled = [r for r in linears if r.decided_by.method == "awq"]
    assert scaled, "no group was folded: the test would prove nothing"
    assert all("awq, gptq: +" in r.detail and "against awq; " in r.detail for r in scaled)
    assert all(r.detail.endswith("check text against rtn)") for r in scaled)
    files = sorted(p.name for p in awq_only.glob("*.safetensors"))
    assert files and files == sorted(p.name for p in out.glob("*.safetensors"))
    for name in files:
        assert (awq_only / name).read_bytes() == (out / name).read_bytes()
    unguarded = _quantize(model, tmp_path / "none", _options(model, Method.AWQ_GPTQ,
                                                            guard=Guard.NONE))  # fmt: skip
    assert "awq+gptq" in {r.decided_by.method for r in unguarded.rows if r.quantized}


def _solves(
    model: Path, out: Path, method: Method, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, Hessian) of every GPTQ solve of a --guard none run, in order."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = gptq.gptq_quantize

    def spy(weight: torch.Tensor, hessian: torch.Tensor, spec: QSpec, **kw: Any) -> Any:
        seen.append((weight.clone(), hessian.clone()))
        return real(weight, hessian, spec, **kw)

    monkeypatch.setattr(gptq, "gptq_quantize", spy)
    _quantize(model, out, _options(model, method, guard=Guard.NONE))
    monkeypatch.setattr(gptq, "gptq_quantize", real)
    return seen


def _energy(weight: torch.Tensor, hessian: torch.Tensor) -> float:
    w = weight.double()
    return float(torch.sum((w @ hessian.double()) * w))


def test_gptq_solves_on_the_smoothed_inputs(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Block 0's Linears see the same inputs in both runs (the embeddings), so the float output
    energy tr(W H W^T) of each smoothed Linear on its smoothed Hessian is the plain GPTQ run's
    (to the bf16 rounding of the folded norm); a Hessian of the unsmoothed inputs paired with
    the smoothed weight (the defect class: statistics from before the fold) is far off."""
    plain = _solves(model, tmp_path / "gptq", Method.GPTQ, monkeypatch)
    smoothed = _solves(model, tmp_path / "awq_gptq", Method.AWQ_GPTQ, monkeypatch)
    assert len(plain) == len(smoothed) == 14
    folded = 0
    block0 = zip(LINEARS, plain[:7], smoothed[:7], strict=True)
    for name, (w0, h0), (w1, h1) in block0:
        assert w0.shape == w1.shape
        if name in ROWS_SCALED:  # its outputs are in other units: tr(W H W^T) differs
            continue
        if torch.equal(w0, w1):  # in no folded group: inputs as the float block's (bf16 norms)
            assert torch.allclose(h1, h0, rtol=1e-2, atol=1e-2 * float(h0.diagonal().mean()))
            continue
        folded += 1
        assert _energy(w1, h1) == pytest.approx(_energy(w0, h0), rel=1e-2)
        assert abs(_energy(w1, h0) / _energy(w0, h0) - 1) > 0.05
    assert folded >= 3


def test_the_method_is_named_on_the_command_line(
    model: Path, tmp_path: Path, invoke: Invoke
) -> None:
    """The stderr line counts each method the Linears got (awq+gptq gives some awq, some gptq,
    some both), where it named the first one for them all."""
    rc, stdout, err = invoke(
        "quantize", str(model), "--method", "awq+gptq", "--text", str(model.parent / "calib.txt"),
        "--check-text", str(model.parent / "check.txt"), "--tokens", "256", "--ctx", "32",
        "--dtype", "int4", "--group-size", "16", "-o", str(tmp_path / "out"), "--json",
    )  # fmt: skip
    assert rc == 0, err
    line = next(x for x in err.splitlines() if "Linear layers of the decoder blocks" in x)
    counts = dict(re.findall(r"([a-z+]+) (?:kept )?for (\d+)", line.split(" of 14 ")[0]))
    assert set(counts) <= {"awq", "gptq", "awq+gptq"} and len(counts) >= 2, line
    rows = {r["name"]: r for r in json.loads(stdout)["tensors"]}
    linears = [r for r in rows.values() if r["name"].endswith("proj.weight")]
    made = Counter(r["decided_by"]["method"] for r in linears)
    assert {m: int(n) for m, n in counts.items()} == {m: n for m, n in made.items() if m != "rtn"}
