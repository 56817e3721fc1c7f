"""quantize HF_DIR --dtype F16 casts a tensor CHUNK elements at a time (reliability.md's 16 MiB
bound), its check of F16's range too: the finite values that became Inf are counted inside the
chunk loop, never with a whole-tensor mask or float32 copy. And the one rule of F16's range
(the cast's result is Inf) decides both the refusal and the auto type's F32 copy."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from qtool.errors import NumericError
from qtool.formats.gguf import hf_export
from qtool.formats.gguf.hf_export import HFTensor, tensor_data

N = 1 << 20
CHUNK = 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_f16_range_check_holds_a_chunk_not_a_tensor(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """numpy's allocations (tracemalloc counts them) while an F16 cast refuses a value beyond
    F16's range near the tensor's end: the F16 output (2 bytes a value) and a few chunk-sized
    buffers; a whole-tensor bool mask would add N bytes."""
    monkeypatch.setattr(hf_export, "CHUNK", CHUNK)
    values = torch.linspace(-1, 1, N, dtype=torch.float32).to(dtype)
    values[N - 3], values[7] = 1e5, -7e4
    t = HFTensor("w", Path("m.safetensors"), "blk.0.w", "F16", (N,), "F32")
    tracemalloc.start()
    try:
        with pytest.raises(NumericError) as err:
            tensor_data(t, values, "other", {})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "2 values beyond F16's range" in str(err.value)
    largest = float(torch.tensor(1e5, dtype=dtype))
    assert f"largest |x| {largest:.6g}" in str(err.value)
    assert peak < 2 * N + 64 * CHUNK, peak


@pytest.mark.parametrize(
    ("value", "overflows"), [(65504.0, False), (65519.0, False), (65520.0, True), (-1e6, True)]
)
def test_the_auto_copy_and_the_refusal_share_f16s_range(
    monkeypatch: pytest.MonkeyPatch, value: float, overflows: bool
) -> None:
    """A value F16 rounds to its largest (65519 -> 65504) is held by the auto type's F16 copy
    and written by --dtype F16; one it rounds to Inf sends the copy to F32 and is refused."""
    values = torch.zeros(64, dtype=torch.float32)
    values[5] = value
    t = HFTensor("w", Path("m.safetensors"), "blk.0.w", "F16", (64,), "F32")
    monkeypatch.setattr(hf_export, "_values", lambda tensors: iter([(t, values)]))
    assert hf_export._overflows_f16([t]) is overflows
    if overflows:
        with pytest.raises(NumericError):
            tensor_data(t, values, "other", {})
    else:
        got = tensor_data(t, values, "other", {}).view(np.float16)
        assert got[5] == np.float16(np.sign(value) * 65504)
