"""Large tensors read and quantized a slab of rows at a time (engine/slabs.py) give the codes
and qparams of one call on the whole tensor, bit for bit, with either kernel; progress moves
within such a tensor; NaN/Inf are counted over the whole tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool import api
from qtool.engine import slabs
from qtool.engine.plan import QuantizeOptions
from qtool.errors import NumericError
from qtool.numerics import select
from qtool.spec import PerChannel, PerGroup, PerTensor, QSpec, RangeMethod, Scheme, StorageDtype

KERNELS = ["torch"] + (["fused"] if select.numba_installed() else [])
SPECS = {
    "int8-channel": QSpec(),
    "asym-uint8-channel": QSpec(Scheme.ASYM, StorageDtype.UINT8, PerChannel(0)),
    "int4-group16": QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(16)),
    "asym-uint4-group7": QSpec(Scheme.ASYM, StorageDtype.UINT4, PerGroup(7)),
    "int8-mse-group32": QSpec(granularity=PerGroup(32), range_method=RangeMethod.MSE),
    "int4-mse-channel": QSpec(Scheme.SYM, StorageDtype.INT4, PerChannel(0), RangeMethod.MSE),
    "int8-tensor (read whole)": QSpec(granularity=PerTensor()),
}


def _model(path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    save_file(
        {
            "a.weight": torch.randn(203, 97, generator=g),  # odd rows: 4-bit padding
            "b.weight": (torch.randn(64, 3, 101, generator=g) * 1e-2).to(torch.bfloat16),
            "c.weight": torch.randn(300, 64, generator=g).to(torch.float16),
            "c.bias": torch.randn(300, generator=g),
        },
        path,
    )


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def start(self, total_bytes: int) -> None:
        self.total = total_bytes

    def advance(self, name: str, nbytes: int) -> None:
        self.calls.append((name, nbytes))


def _quantize(src: Path, out: Path, spec: QSpec, slab_bytes: int, mp: pytest.MonkeyPatch):
    mp.setattr(slabs, "SLAB_BYTES", slab_bytes)
    progress = Recorder()
    summary = api.quantize(src, out, QuantizeOptions(spec), device="cpu", progress=progress)
    return summary, progress


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
def test_slabs_give_the_bytes_of_a_whole_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: QSpec, kernel: str
) -> None:
    monkeypatch.setenv(select.ENV, kernel)
    src = tmp_path / "m.safetensors"
    _model(src)
    whole, _ = _quantize(src, tmp_path / "w.safetensors", spec, 1 << 30, monkeypatch)
    sliced, progress = _quantize(src, tmp_path / "s.safetensors", spec, 2048, monkeypatch)
    for name in ("w", "s"):
        assert (tmp_path / f"{name}.safetensors").exists()
    a, b = load_file(tmp_path / "w.safetensors"), load_file(tmp_path / "s.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    qa = load_file(tmp_path / "w.qparams.safetensors")
    qb = load_file(tmp_path / "s.qparams.safetensors")
    assert qa.keys() == qb.keys() and all(torch.equal(qa[k], qb[k]) for k in qa)
    for ra, rb in zip(whole.rows, sliced.rows, strict=True):
        assert (ra.errors is None) == (rb.errors is None)
        if ra.errors is not None and rb.errors is not None:
            assert rb.errors.numel == ra.errors.numel and rb.errors.max_abs == ra.errors.max_abs
            assert rb.errors.sq_error == pytest.approx(ra.errors.sq_error, rel=1e-12)
            assert rb.errors.sq_signal == pytest.approx(ra.errors.sq_signal, rel=1e-12)
    steps = [n for name, n in progress.calls if name == "a.weight" and n]
    if isinstance(spec.granularity, PerTensor):
        assert steps == [203 * 97 * 4]
    else:  # 2048-byte slabs of 388-byte rows: 5 rows at a time
        assert len(steps) == 41 and sum(steps) == 203 * 97 * 4
    assert sum(n for _, n in progress.calls) == progress.total


def test_progress_names_the_tensor_before_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "m.safetensors"
    _model(src)
    _, progress = _quantize(src, tmp_path / "q.safetensors", QSpec(), 2048, monkeypatch)
    names = [name for name, _ in progress.calls]
    firsts = [progress.calls[names.index(n)] for n in dict.fromkeys(names)]
    assert all(n == 0 for _, n in firsts)  # each tensor is named (0 bytes) as it starts


def test_nonfinite_values_are_counted_over_every_slab(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(64, 32)
    x[3, 1] = x[40, 2] = float("nan")
    x[60, 0] = float("inf")
    save_file({"w": x}, tmp_path / "m.safetensors")
    monkeypatch.setattr(slabs, "SLAB_BYTES", 1024)
    with pytest.raises(NumericError, match="has 3 NaN/Inf values"):
        api.quantize(tmp_path / "m.safetensors", tmp_path / "q.safetensors",
                     QuantizeOptions(QSpec()), device="cpu")  # fmt: skip
