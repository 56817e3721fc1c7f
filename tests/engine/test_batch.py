"""Tiny tensors quantized in batches (engine/batch.py): the same bytes as one at a time.

Three witnesses: the batched run against the same run with batching off (every spec the batch
takes, every float dtype, shapes that do and do not share a row length, 4-bit packing with odd
and even last dimensions); against SHA-256 digests of files written by qtool before batching
existed; and errors that still name the tensor at fault.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qtool import api
from qtool.engine import batch
from qtool.engine.plan import QuantizeOptions
from qtool.errors import NumericError
from qtool.formats.qtool.manifest import sidecar_path
from qtool.results import QuantizeRow
from qtool.spec import PerChannel, PerGroup, PerTensor, QSpec, RangeMethod, Scheme, StorageDtype

SHAPES = [(16, 16), (8, 32), (4, 3, 3), (64, 4), (2, 2), (3, 5), (5, 7, 2), (1, 9), (7, 1)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def values(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic float32 values without a random generator: k / 16 for small integers k
    (exact in every float dtype; many codes land on rounding ties), zero rows included."""
    n = math.prod(shape)
    k = (torch.arange(n, dtype=torch.int64) * (31 + 2 * seed) + seed * 7) % 97 - 48
    x = (k.float() / 16).reshape(shape)
    if seed % 11 == 3:
        x[0] = 0.0  # an all-zero row (channel)
    return x


def checkpoint(path: Path, count: int = 300) -> Path:
    """Tiny tensors of every dtype and shape above, with 1-D biases and an int tensor between."""
    tensors: dict[str, torch.Tensor] = {}
    for i in range(count):
        shape = SHAPES[i % len(SHAPES)]
        dtype = DTYPES[(i // len(SHAPES)) % len(DTYPES)]
        tensors[f"layer.{i}.weight"] = values(i, shape).to(dtype)
        tensors[f"layer.{i}.bias"] = values(i + 1, (shape[0],))
    tensors["step"] = torch.arange(3)
    tensors["big.weight"] = values(5, (160, 128))  # above TINY_ELEMS: quantized on its own
    save_file(tensors, path)
    return path


SPECS = [
    QSpec(),
    QSpec(Scheme.ASYM, StorageDtype.UINT8, PerChannel(0)),
    QSpec(Scheme.SYM, StorageDtype.UINT8, PerTensor()),
    QSpec(Scheme.ASYM, StorageDtype.INT8, PerTensor()),
    QSpec(Scheme.SYM, StorageDtype.INT8, PerGroup(4)),
    QSpec(Scheme.ASYM, StorageDtype.UINT8, PerGroup(16)),
    QSpec(Scheme.SYM, StorageDtype.INT4, PerChannel(0)),
    QSpec(Scheme.ASYM, StorageDtype.UINT4, PerTensor()),
    QSpec(Scheme.ASYM, StorageDtype.INT4, PerGroup(3)),
    QSpec(Scheme.SYM, StorageDtype.UINT4, PerGroup(8)),
    QSpec(Scheme.SYM, StorageDtype.INT8, PerChannel(1)),  # not batched: checks the mixing
    QSpec(Scheme.SYM, StorageDtype.INT8, PerChannel(0), RangeMethod.MSE),  # not batched
]


def run(src: Path, out: Path, spec: QSpec, include: tuple[str, ...] = ()) -> list[QuantizeRow]:
    return api.quantize(src, out, QuantizeOptions(spec, include), device="cpu").rows


def files(out: Path) -> tuple[bytes, bytes]:
    return out.read_bytes(), sidecar_path(out).read_bytes()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe().replace(" ", "-"))
def test_batches_write_the_bytes_of_one_tensor_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: QSpec
) -> None:
    src = checkpoint(tmp_path / "m.safetensors")
    include = ("*.weight", "*.bias") if isinstance(spec.granularity, PerTensor) else ()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    batched = run(src, tmp_path / "a" / "q.safetensors", spec, include)
    monkeypatch.setattr(batch, "TINY_ELEMS", 0)  # every tensor on its own
    alone = run(src, tmp_path / "b" / "q.safetensors", spec, include)
    assert files(tmp_path / "a" / "q.safetensors") == files(tmp_path / "b" / "q.safetensors")
    assert len(batched) == len(alone) and sum(r.quantized for r in batched) >= 300
    for a, b in zip(batched, alone, strict=True):
        assert (a.name, a.detail, a.scale_range) == (b.name, b.detail, b.scale_range)
        if b.errors is None:
            assert a.errors is None
            continue
        assert a.errors is not None
        assert (a.errors.numel, a.errors.max_abs) == (b.errors.numel, b.errors.max_abs), a.name
        assert a.errors.sq_error == pytest.approx(b.errors.sq_error, rel=1e-12, abs=0)
        assert a.errors.sq_signal == pytest.approx(b.errors.sq_signal, rel=1e-12, abs=0)


# SHA-256 of (quantized file, sidecar) as qtool wrote them before batching (commit b6f775a).
GOLDEN = {
    "sym-int8-axis-0": (
        "9414214ef555ad3776b7a809122186eeb42b519f122ddf88d1121763b38dd683",
        "a34268a80fed78d66a540105b7d2600cbbd947a3a5d73a22e1fa538d8d38a97d",
    ),
    "asym-uint8-tensor": (
        "66beb952dfc318a80e57a6e196e610a5f335945c017546076f3f44485a3b0699",
        "8319f65b4ee604f80e42eb942c09545675b94f7f63353f7d320a444e2f95935e",
    ),
    "sym-int4-group-8": (
        "9b48938a76a93556e413dcd5986b3c91338e06263a11b98f1013dd8c84a236b4",
        "0cbb33aea16fef527ff1b94c75c58020b26de2845d337ea82c7e100fd0b55cc4",
    ),
    "asym-uint4-axis-0": (
        "22c573070c3e2842b109c29c6a3f0837b85c9c1cce4c938334286b3764707811",
        "4885a5aefb218860eb5d42279b8370624ffd540d4b35451b0cc94217a2516ad1",
    ),
}
GOLDEN_SPECS = {
    "sym-int8-axis-0": QSpec(),
    "asym-uint8-tensor": QSpec(Scheme.ASYM, StorageDtype.UINT8, PerTensor()),
    "sym-int4-group-8": QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(8)),
    "asym-uint4-axis-0": QSpec(Scheme.ASYM, StorageDtype.UINT4, PerChannel(0)),
}


@pytest.mark.parametrize("label", list(GOLDEN))
def test_output_files_are_those_qtool_wrote_before_batching(tmp_path: Path, label: str) -> None:
    src = checkpoint(tmp_path / "m.safetensors")
    out = tmp_path / "q.safetensors"
    run(src, out, GOLDEN_SPECS[label])
    digests = tuple(hashlib.sha256(data).hexdigest() for data in files(out))
    assert digests == GOLDEN[label]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_bad_tiny_tensor_is_named_and_can_be_kept(tmp_path: Path, bad: float) -> None:
    tensors = {f"t.{i}.weight": values(i, (4, 4)) for i in range(50)}
    tensors["t.17.weight"][2, 3] = bad
    src = tmp_path / "m.safetensors"
    save_file(tensors, src)
    with pytest.raises(NumericError, match="NaN/Inf") as caught:
        run(src, tmp_path / "q.safetensors", QSpec())
    assert caught.value.tensor == "t.17.weight"
    options = QuantizeOptions(QSpec(), keep_nonfinite=True)
    rows = api.quantize(src, tmp_path / "q.safetensors", options, device="cpu").rows
    assert [r.name for r in rows if not r.quantized] == ["t.17.weight"]


def test_a_tiny_tensor_at_the_float32_limit_is_named(tmp_path: Path) -> None:
    tensors = {f"t.{i}.weight": values(i, (4, 4)) for i in range(20)}
    tensors["t.5.weight"][1] = torch.finfo(torch.float32).min  # a mask: the grid overflows
    src = tmp_path / "m.safetensors"
    save_file(tensors, src)
    with pytest.raises(NumericError) as caught:
        run(src, tmp_path / "q.safetensors", QSpec())
    assert caught.value.tensor == "t.5.weight"
