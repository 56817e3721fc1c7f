"""`quantize --method` on every available device (CUDA skipped where there is none; the ids
name the device, so scripts/gpu_check.sh's `-k cuda` runs them on a GPU): the same device and
thread count give the same bytes, run after run; across devices GPTQ's codes may differ
(matmul order), so what is promised is the model-level figures within a tolerance
(docs/calibration.md, "Devices"); `--device cuda` without a GPU is the one-line error before
anything runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from qtool import api  # noqa: E402
from qtool.calibration import Calibration, Method  # noqa: E402
from qtool.engine.plan import QuantizeOptions  # noqa: E402
from qtool.results import QuantizeSummary  # noqa: E402
from qtool.spec import PerGroup, QSpec, Scheme, StorageDtype  # noqa: E402
from tests.conftest import Invoke  # noqa: E402
from tests.eval_models import build  # noqa: E402

CTX = 32
TEXT = " ".join(f"alpha {i} beta {i * 7 % 13} gamma." for i in range(80))
CHECK = " ".join(f"Delta{i}: epsilon zeta eta {i % 5}!" for i in range(40))
SPEC = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(16))
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
METHODS = [Method.GPTQ, Method.AWQ_GPTQ]
RELATIVE_MSE = 0.10
"""The largest relative difference of the Linears' summed squared weight error between a CPU
and a CUDA run (docs/calibration.md, "Devices")."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("devices")
    (root / "calib.txt").write_text(TEXT)
    (root / "check.txt").write_text(CHECK)
    return build(root / "llama", "llama")


def _run(model: Path, out: Path, which: Method, device: str) -> QuantizeSummary:
    root = model.parent
    data = Calibration(which, texts=(root / "calib.txt",), tokens=8 * CTX, ctx=CTX,
                       check_texts=(root / "check.txt",))  # fmt: skip
    options = QuantizeOptions(SPEC, calibration=dataclasses.replace(data))
    return api.quantize(model, out, options, device=device, force=True, threads=1)


def _bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.safetensors"))}


@pytest.mark.parametrize("which", METHODS)
@pytest.mark.parametrize("device", DEVICES)
def test_same_device_and_threads_same_bytes(
    model: Path, tmp_path: Path, which: Method, device: str
) -> None:
    _run(model, tmp_path / "a", which, device)
    _run(model, tmp_path / "b", which, device)
    first = _bytes(tmp_path / "a")
    assert first and first == _bytes(tmp_path / "b")


def _linear_error(summary: QuantizeSummary) -> float:
    rows = [r for r in summary.rows if r.quantized and ".layers." in r.name]
    assert len(rows) == 14 and all(r.errors is not None for r in rows)
    return sum(r.errors.sq_error for r in rows if r.errors is not None)


@CUDA
@pytest.mark.parametrize("which", METHODS)
def test_cuda_and_cpu_agree_within_the_tolerance(
    model: Path, tmp_path: Path, which: Method
) -> None:
    """The Linears' summed squared weight error of a CUDA run within RELATIVE_MSE of the CPU
    run's, and the guard's choice the same for at least 12 of the 14 Linears."""
    cpu = _run(model, tmp_path / "cpu", which, "cpu")
    cuda = _run(model, tmp_path / "cuda", which, "cuda")
    assert _linear_error(cuda) == pytest.approx(_linear_error(cpu), rel=RELATIVE_MSE)
    chose = {r.name: r.decided_by.method for r in cpu.rows if r.decided_by is not None}
    same = sum(chose.get(r.name) == r.decided_by.method for r in cuda.rows
               if r.decided_by is not None and r.decided_by.method is not None)  # fmt: skip
    assert same >= 12


@pytest.mark.parametrize("which", ["gptq", "awq", "awq+gptq"])
def test_cuda_without_a_gpu_is_the_one_line_error(
    model: Path, tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    rc, stdout, err = invoke(
        "quantize", str(model), "--method", which, "--text", str(model.parent / "calib.txt"),
        "--tokens", "256", "--ctx", "32", "--dtype", "int4", "--group-size", "16",
        "--device", "cuda", "-o", str(out), "--json",
    )  # fmt: skip
    assert rc == 1 and stdout == "" and not out.exists()
    assert json.loads(err)["error"]["code"] == "device"
    rc, stdout, err = invoke(
        "quantize", str(model), "--method", which, "--device", "cuda", "-o", str(out)
    )
    assert rc == 1 and stdout == "" and not out.exists()
    assert err.count("\n") == 1 and "no CUDA device" in err and "Traceback" not in err
