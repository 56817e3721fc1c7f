"""Linears with the same input share one Hessian (engine/methods/gptq.HessianProbe): q/k/v and
gate/up of each block are accumulated once, the outputs are byte for byte those of one Hessian
per Linear, and a sharer that is later fed another input is an error, never a wrong Hessian."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from qtool import api  # noqa: E402
from qtool.calibration import Calibration, Method  # noqa: E402
from qtool.engine.methods import gptq as method  # noqa: E402
from qtool.engine.plan import QuantizeOptions  # noqa: E402
from qtool.numerics import gptq  # noqa: E402
from tests.engine.test_gptq_pass import CTX, SPEC, calibration_model  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return calibration_model(tmp_path_factory.mktemp("shared"))


def _run(
    model: Path, out: Path, which: Method, share: bool, monkeypatch: pytest.MonkeyPatch
) -> int:
    """The run's output in `out`; the rows its Hessians added up."""
    root = model.parent
    data = Calibration(which, texts=(root / "calib.txt",), tokens=8 * CTX, ctx=CTX,
                       check_texts=(root / "check.txt",))  # fmt: skip
    rows = 0
    add = gptq.Hessian.add

    def counted(self: gptq.Hessian, x: torch.Tensor) -> None:
        nonlocal rows
        rows += x.reshape(-1, x.shape[-1]).shape[0]
        add(self, x)

    monkeypatch.setattr(method.HessianProbe, "share", share)
    monkeypatch.setattr(gptq.Hessian, "add", counted)
    options = QuantizeOptions(SPEC, calibration=dataclasses.replace(data))
    api.quantize(model, out, options, device="cpu", force=True)
    monkeypatch.undo()
    return rows


@pytest.mark.parametrize("which", [Method.GPTQ, Method.AWQ_GPTQ])
def test_one_hessian_per_input_same_bytes(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: Method
) -> None:
    """Shared: 4 Hessians' rows per block and window (q/k/v, o, gate/up, down) instead of 7,
    and the same output bytes as a Hessian per Linear."""
    own = _run(model, tmp_path / "own", which, False, monkeypatch)
    shared = _run(model, tmp_path / "shared", which, True, monkeypatch)
    assert own > 0 and shared * 7 == own * 4
    files = sorted(p.name for p in (tmp_path / "own").glob("*.safetensors"))
    assert files
    for name in files:
        assert (tmp_path / "own" / name).read_bytes() == (tmp_path / "shared" / name).read_bytes()


def test_a_sharer_fed_another_input_is_an_error() -> None:
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 2)
    probe = method.HessianProbe({"a": a, "b": b})
    x, y = torch.randn(5, 4), torch.randn(5, 4)
    with probe:
        a(x)
        b(x)  # the object a just saw: b shares a's Hessian
        assert probe.owner == {"a": "a", "b": "a"}
        a(y)
        with pytest.raises(RuntimeError, match="b shares the Hessian of a"):
            b(x)
    h = probe.take("b", "fit")
    assert h is not None and probe.take("a", "fit") is not None
    assert probe.hessians == {}  # let go once both took it
