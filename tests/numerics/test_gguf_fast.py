"""The fused (numba) GGUF kernels: the C goldens, the torch kernels' bytes on any input
(hypothesis), gguf.quants' floats on any bytes, and when they are chosen."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qtool.errors import UsageError
from qtool.gguf_types import GGML_TYPES
from qtool.numerics import gguf as G
from qtool.numerics.gguf import fast
from qtool.numerics.select import Kernel
from tests.reference_gguf import REFERENCE

pytest.importorskip("numba")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

GOLDEN = np.load(Path(__file__).parents[1] / "data" / "gguf_golden.npz")
K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
LEGACY = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
FUSED, TORCH = Kernel.FUSED, Kernel.TORCH


def _q(x: np.ndarray, qtype: str, kernel: Kernel) -> np.ndarray:
    return G.quantize(torch.from_numpy(x), qtype, kernel=kernel).numpy()


def _bad_rows(ours: np.ndarray, ref: np.ndarray) -> list[int]:
    return np.nonzero((ours != ref).any(axis=1))[0].tolist()


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_types_give_the_c_goldens(qtype: str) -> None:
    assert _bad_rows(_q(GOLDEN["x"], qtype, FUSED), GOLDEN[qtype.lower()]) == []


@pytest.mark.parametrize("qtype", LEGACY)
def test_legacy_types_give_the_c_goldens(qtype: str) -> None:
    ours = _q(GOLDEN["legacy_x"], qtype, FUSED)
    assert _bad_rows(ours, GOLDEN[f"legacy_{qtype.lower()}"]) == []


@pytest.mark.parametrize("qtype", [*LEGACY, *K_TYPES])
def test_the_hostile_rows_give_the_torch_kernels_bytes(qtype: str) -> None:
    x = GOLDEN["x"]
    assert _bad_rows(_q(x, qtype, FUSED), _q(x, qtype, TORCH)) == []


def _values() -> st.SearchStrategy[float]:
    """Mixed magnitudes, signed zeros, ties, subnormals, values whose arithmetic overflows.
    Finite: with NaN or Inf in a block the torch kernels' reductions (amax, amin) differ from
    C's scans, which skip NaN and start from +-FLT_MAX (the fused kernels are C's: the C
    goldens' hostile rows); qtool refuses non-finite weights before quantizing them."""
    return st.one_of(
        st.floats(-2.0, 2.0, width=32),
        st.sampled_from([0.0, -0.0, 0.5, -0.5, 1.0, 1e-38, -3e-39, 7.0, 1e-45]),
        st.floats(-(2.0**120), 2.0**120, width=32, allow_subnormal=True),
        st.sampled_from([3e38, -3e38, 3.4028235e38]),
    )


@settings(max_examples=60, deadline=None)
@given(
    x=hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.just(64)), elements=_values()),
    exp=st.integers(-30, 30),
    qtype=st.sampled_from(LEGACY),
)
def test_legacy_types_give_the_torch_kernels_bytes(x: np.ndarray, exp: int, qtype: str) -> None:
    with np.errstate(all="ignore"):
        x = (x * np.float32(2.0**exp)).astype(np.float32)
    assume(np.isfinite(x).all())
    assert _bad_rows(_q(x, qtype, FUSED), _q(x, qtype, TORCH)) == []


@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.just(256)), elements=_values()),
    exp=st.integers(-30, 30),
    qtype=st.sampled_from(K_TYPES),
)
def test_k_types_give_the_torch_kernels_bytes(x: np.ndarray, exp: int, qtype: str) -> None:
    """Several super-blocks per call: the fused kernels run all their sub-blocks side by side."""
    with np.errstate(all="ignore"):
        x = (x * np.float32(2.0**exp)).astype(np.float32)
    assume(np.isfinite(x).all())
    assert _bad_rows(_q(x, qtype, FUSED), _q(x, qtype, TORCH)) == []


@settings(max_examples=25, deadline=None)
@given(
    x=hnp.arrays(np.float32, 256, elements=st.floats(-(2.0**100), 2.0**100, width=32)),
    qtype=st.sampled_from(K_TYPES),
)
def test_k_types_give_the_scalar_transcription_bytes(x: np.ndarray, qtype: str) -> None:
    assert _q(x[None], qtype, FUSED).tobytes() == REFERENCE[qtype](x)


def _same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    nan = np.isnan(a)
    return bool((nan == np.isnan(b)).all() and (a.view(np.uint32) == b.view(np.uint32))[~nan].all())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), qtype=st.sampled_from(fast.DEQUANTIZE_TYPES))
def test_dequantize_gives_gguf_quants_floats_on_any_bytes(seed: int, qtype: str) -> None:
    size = GGML_TYPES[qtype].type_size
    raw = np.random.default_rng(seed).integers(0, 256, (3, 2 * size), dtype=np.uint8)
    ours = G.dequantize(torch.from_numpy(raw), qtype, kernel=FUSED).numpy()
    with np.errstate(all="ignore"):
        ref = quants.dequantize(raw, GGMLQuantizationType[qtype])
    assert _same_floats(ours, ref)
    assert _same_floats(ours, G.dequantize(torch.from_numpy(raw), qtype, kernel=TORCH).numpy())


@pytest.mark.parametrize("qtype", [*LEGACY, *K_TYPES])
def test_shapes_empty_inputs_and_other_dtypes(qtype: str) -> None:
    t = GGML_TYPES[qtype]
    x = torch.from_numpy(GOLDEN["x"][:12]).reshape(3, 2, 512)
    raw = G.quantize(x, qtype, kernel=FUSED)
    assert raw.shape == (3, 2, t.row_bytes(512))
    assert torch.equal(raw, G.quantize(x.to(torch.float64), qtype, kernel=FUSED))
    back = G.dequantize(raw, qtype, kernel=FUSED)
    assert back.shape == x.shape
    assert _same_floats(back.numpy(), G.dequantize(raw, qtype, kernel=TORCH).numpy())
    assert G.quantize(torch.zeros(0, 256), qtype, kernel=FUSED).shape == (0, t.row_bytes(256))
    empty = torch.zeros(0, t.type_size, dtype=torch.uint8)
    assert G.dequantize(empty, qtype, kernel=FUSED).shape == (0, t.block_size)


def test_qtool_kernel_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setenv("QTOOL_KERNEL", "torch")
    assert not fast.chosen("Q4_K", cpu, 1 << 30, True)
    monkeypatch.setenv("QTOOL_KERNEL", "fused")
    assert fast.chosen("Q4_K", cpu, 256, True)
    assert not fast.chosen("Q4_K", torch.device("meta"), 256, True)  # not a CPU tensor
    assert not fast.chosen("F16", cpu, 256, True)  # not covered
    monkeypatch.setenv("QTOOL_KERNEL", "auto")
    fresh = fast._Loader()
    monkeypatch.setattr(fast, "_LOADER", fresh)
    assert not fast.chosen("Q8_0", cpu, 1024, True)  # too little work to pay for numba
    assert not fresh.tried
    assert fast.chosen("Q4_K", cpu, 1 << 22, True)  # 16 MB of K-quants: worth it
    assert fresh.modules is not None


def test_fused_without_numba_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = fast._Loader()
    broken.tried, broken.error = True, ImportError("No module named 'numba'")
    monkeypatch.setattr(fast, "_LOADER", broken)
    monkeypatch.setenv("QTOOL_KERNEL", "fused")
    with pytest.raises(UsageError, match=r"numba cannot be loaded.*qtool\[fast\]"):
        G.quantize(torch.zeros(1, 256), "Q4_K")
    monkeypatch.setenv("QTOOL_KERNEL", "auto")  # auto falls back to the torch kernels
    assert G.quantize(torch.zeros(1, 256), "Q4_K").shape == (1, 144)


NONFINITE = np.load(Path(__file__).parents[1] / "data" / "gguf_golden_nonfinite.npz")


@pytest.mark.parametrize("qtype", [*LEGACY, *K_TYPES])
def test_blocks_with_nan_and_inf_give_the_c_bytes(qtype: str) -> None:
    """Where C's scans skip a NaN that torch's reductions propagate (scripts/gguf_golden.py
    --nonfinite): the fused kernels are C's."""
    assert _bad_rows(_q(NONFINITE["x"], qtype, FUSED), NONFINITE[qtype.lower()]) == []


def test_fused_error_stats_are_metrics_error_stats() -> None:
    from qtool.numerics.metrics import error_stats

    fast._LOADER.now()
    x = torch.randn(3, 100_003, generator=torch.Generator().manual_seed(1))
    x_hat = G.dequantize(G.quantize(x[:, :99_840], "Q4_K"), "Q4_K")
    x = x[:, :99_840].contiguous()
    ours, ref = fast.error_stats(x, x_hat), error_stats(x, x_hat)
    assert ours.numel == ref.numel and ours.max_abs == ref.max_abs
    assert ours.sq_error == pytest.approx(ref.sq_error, rel=1e-12)
    assert ours.sq_signal == pytest.approx(ref.sq_signal, rel=1e-12)
    nan = x_hat.clone()
    nan[1, 7] = float("nan")
    assert np.isnan(fast.error_stats(x, nan).max_abs)
    big = torch.tensor([3e38, -3e38]), torch.tensor([-3e38, 3e38])  # float32 e overflows
    assert fast.error_stats(*big) == error_stats(*big)
    assert np.isfinite(fast.error_stats(*big).max_abs)
