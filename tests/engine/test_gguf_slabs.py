"""A float GGUF quantized to a GGUF block type a slab of rows at a time (engine/slabs.py) gives
the bytes of one call on the whole tensor, for every type qtool quantizes to, for F32 and F16
inputs and for a 3-D tensor (its rows are those of its last two dimensions); progress moves
within a tensor slab by slab."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qtool import api
from qtool.engine import slabs
from qtool.engine.plan import QuantizeOptions
from qtool.results import QuantizeSummary
from qtool.spec import FormatName, QSpec, gguf_spec

gguf = pytest.importorskip("gguf")


class Recorder:
    """The progress a run reports: each tensor's name and bytes as they are done."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def start(self, total_bytes: int) -> None:
        self.total = total_bytes

    def advance(self, name: str, nbytes: int) -> None:
        self.calls.append((name, nbytes))


TENSORS = {  # name -> (torch shape, dtype)
    "blk.0.ffn_up.weight": ((203, 256), np.float32),
    "blk.0.ffn_down.weight": ((96, 512), np.float16),
    "blk.0.ffn_up_exps.weight": ((3, 37, 256), np.float32),
}


def _float_gguf(path: Path) -> Path:
    rng = np.random.default_rng(5)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    for name, (shape, dtype) in TENSORS.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _quantize(
    src: Path, out: Path, spec: QSpec, slab_bytes: int, mp: pytest.MonkeyPatch
) -> tuple[QuantizeSummary, Recorder]:
    mp.setattr(slabs, "SLAB_BYTES", slab_bytes)
    progress = Recorder()
    options = QuantizeOptions(spec, format=FormatName.GGUF)
    return api.quantize(src, out, options, device="cpu", progress=progress), progress


@pytest.mark.parametrize("kernel", ["torch", "fused"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_slabs_give_the_bytes_of_a_whole_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: str, kernel: str
) -> None:
    monkeypatch.setenv("QTOOL_KERNEL", kernel)
    src = _float_gguf(tmp_path / "f.gguf")
    spec = gguf_spec(qtype)
    whole, _ = _quantize(src, tmp_path / "w.gguf", spec, 1 << 30, monkeypatch)
    sliced, progress = _quantize(src, tmp_path / "s.gguf", spec, 4096, monkeypatch)
    assert (tmp_path / "w.gguf").read_bytes() == (tmp_path / "s.gguf").read_bytes()
    assert [r.out_dtype for r in whole.rows] == [r.out_dtype for r in sliced.rows]
    assert all(r.quantized for r in sliced.rows), sliced.rows
    for ra, rb in zip(whole.rows, sliced.rows, strict=True):
        assert ra.errors is not None and rb.errors is not None
        assert rb.errors.numel == ra.errors.numel and rb.errors.max_abs == ra.errors.max_abs
        assert rb.errors.sq_error == pytest.approx(ra.errors.sq_error, rel=1e-12)
        assert rb.errors.sq_signal == pytest.approx(ra.errors.sq_signal, rel=1e-12)
    for name, (shape, dtype) in TENSORS.items():
        row_bytes = int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
        steps = [n for tensor, n in progress.calls if tensor == name and n]
        rows = max(1, 4096 // row_bytes)
        assert len(steps) == -(-shape[0] // rows) > 1, (name, steps)
        assert sum(steps) == row_bytes * shape[0]


def test_the_kernel_choice_sees_the_whole_tensor_not_a_slab(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QTOOL_KERNEL=auto loads the fused kernels when a run's work is worth it; a slab of a
    large tensor alone looks too small, so the run tells it the whole tensors' work first (a
    1 GiB F32 tensor went to Q8_0 through the torch kernels: 2 min instead of seconds)."""
    from qtool.numerics.gguf import fast

    monkeypatch.setenv("QTOOL_KERNEL", "auto")
    loader = fast._Loader()
    monkeypatch.setattr(fast, "_LOADER", loader)
    seconds = fast.torch_seconds("Q8_0", 203 * 256, True)  # the largest tensor's work
    monkeypatch.setattr(fast, "LOAD_SECONDS", seconds * 1.5)  # over it, under the run's
    src = _float_gguf(tmp_path / "f.gguf")
    _quantize(src, tmp_path / "s.gguf", gguf_spec("Q8_0"), 4096, monkeypatch)
    assert loader.tried
