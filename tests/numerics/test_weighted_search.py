"""The mse range search weighted by an importance matrix (docs/numerics.md, "The mse search
weighted by an importance matrix"): against a straightforward reference, group by group; equal
weights give today's codes; every layout (groups, a shorter last group, rows, stacked experts,
rows longer than a slab, the whole-tensor path) and both kernel choices give the same codes."""

from __future__ import annotations

import pytest
import torch

from qtool.numerics import kernels, ranges, select
from qtool.numerics.range_methods import ColumnWeights, search_candidates
from qtool.numerics.ranges import IntRange
from qtool.spec import PerChannel, PerGroup, PerTensor, QSpec, RangeMethod, Scheme, StorageDtype


def _spec(scheme: Scheme, dtype: StorageDtype, gran: object) -> QSpec:
    return QSpec(scheme, dtype, gran, RangeMethod.MSE)  # type: ignore[arg-type]


def _reference(x2: torch.Tensor, h2: torch.Tensor, spec: QSpec, size: int) -> torch.Tensor:
    """Codes [C, K] by the definition: per group, every candidate's sum h_j (w_j - w^_j)^2
    (float64), the first smallest kept."""
    r = IntRange.of(spec)
    cands = search_candidates(spec, tuple(x2.shape))
    out = torch.empty(x2.shape, dtype=torch.float32)
    for row in range(x2.shape[0]):
        for g0 in range(0, x2.shape[1], size):
            v = x2[row, g0 : g0 + size].float()
            h = h2[row if h2.shape[0] > 1 else 0, g0 : g0 + size].double()
            best, codes = None, None
            for p in cands:
                lo, hi = (v.min().clamp(max=0) * p).reshape(1), (v.max().clamp(min=0) * p)
                scale, zp = ranges.qparams_from_range(
                    lo, hi.reshape(1), r.qmin, r.qmax, r.symmetric, r.sym_zero_point
                )
                q = torch.clamp(torch.round(v / scale) + zp, r.qmin, r.qmax)
                err = ((q - zp) * scale - v).double()
                sse = float((h * err.square()).sum())
                if best is None or sse < best:
                    best, codes = sse, q
            assert codes is not None
            out[row, g0 : g0 + size] = codes
    return out


def _codes(x: torch.Tensor, spec: QSpec, **kw: object) -> torch.Tensor:
    """Unpacked float codes of kernels.quantize_tensor, as [C, K]."""
    qt = kernels.quantize_tensor(x, spec, **kw)  # type: ignore[arg-type]
    q = qt.q
    if spec.dtype.packed:
        from qtool.numerics.packing import unpack_nibbles

        q = unpack_nibbles(q, x.shape[-1], spec.dtype.signed).reshape(x.shape)
    return q.float().reshape(x.shape[0], -1)


def _data(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x.view(-1)[::37] *= 6  # outliers, so that clipping candidates compete
    h = torch.rand((1, shape[-1]), generator=g).pow(4) * 10  # a few columns carry most
    return x, h


@pytest.mark.parametrize("scheme", [Scheme.SYM, Scheme.ASYM])
@pytest.mark.parametrize(("k", "size"), [(128, 32), (100, 32), (64, 64)])
def test_weighted_codes_equal_the_reference(scheme: Scheme, k: int, size: int) -> None:
    x, h = _data((6, k))
    dtype = StorageDtype.INT4 if scheme is Scheme.SYM else StorageDtype.UINT4
    gran = PerChannel(0) if size == k else PerGroup(size)
    spec = _spec(scheme, dtype, gran)
    got = _codes(x, spec, weights=ColumnWeights(h))
    want = _reference(x, h, spec, size)
    assert torch.equal(got, want)
    # the weights are what changed the codes: the unweighted search chooses otherwise here
    assert not torch.equal(_codes(x, spec), got)


def test_equal_weights_give_the_unweighted_codes() -> None:
    """h all equal (1, and a power of two, which scales every error sum exactly): the choices
    of today's mse search, for groups, rows, the whole-tensor path and 8 bits."""
    x, _ = _data((8, 96), seed=3)
    for gran, dtype in [
        (PerGroup(32), StorageDtype.INT4),
        (PerChannel(0), StorageDtype.INT8),
        (PerTensor(), StorageDtype.INT4),
        (PerChannel(1), StorageDtype.INT8),
    ]:
        spec = _spec(Scheme.SYM, dtype, gran)
        plain = kernels.quantize_tensor(x, spec)
        for value in (1.0, 4.0):
            w = ColumnWeights(torch.full((1, 96), value))
            weighted = kernels.quantize_tensor(x, spec, weights=w)
            assert torch.equal(weighted.q, plain.q)
            assert weighted.choice is not None and plain.choice is not None
            assert torch.equal(weighted.choice, plain.choice)


def test_slabs_and_whole_path_give_the_same_codes() -> None:
    """Rows longer than a slab (walked in pieces, and per channel through the whole-tensor
    search) choose as whole rows do."""
    x, h = _data((4, 256), seed=5)
    w = ColumnWeights(h)
    for gran in (PerGroup(64), PerChannel(0)):
        spec = _spec(Scheme.SYM, StorageDtype.INT4, gran)
        big = kernels.quantize_tensor(x, spec, weights=w)
        small = kernels.quantize_tensor(x, spec, weights=w, block_elems=64)
        assert torch.equal(big.q, small.q)
        assert big.choice is not None and small.choice is not None
        assert torch.equal(big.choice, small.choice)
    want = _reference(x, h, _spec(Scheme.SYM, StorageDtype.INT4, PerChannel(0)), 256)
    got = _codes(x, _spec(Scheme.SYM, StorageDtype.INT4, PerChannel(0)), weights=w, block_elems=64)
    assert torch.equal(got, want)


def test_stacked_experts_take_their_own_rows() -> None:
    """[E, out, in]: expert e's columns weigh h[e, j] (its rows of the matrix view are whole
    experts), as if each expert were quantized alone with its own weights."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn((3, 4, 32), generator=g)
    h = torch.rand((3, 32), generator=g).pow(4) * 10
    spec = _spec(Scheme.SYM, StorageDtype.INT4, PerGroup(16))
    got = _codes(x, spec, weights=ColumnWeights(h)).reshape(x.shape)
    for e in range(3):
        alone = _codes(x[e], spec, weights=ColumnWeights(h[e : e + 1]))
        assert torch.equal(got[e], alone)
    # a slab of experts takes its experts' rows
    part = _codes(x[1:3], spec, weights=ColumnWeights(h).rows(1, 3)).reshape(2, 4, 32)
    assert torch.equal(part, got[1:3])


def test_min_max_ignores_the_weights() -> None:
    x, h = _data((4, 64))
    spec = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32))
    assert torch.equal(
        kernels.quantize_tensor(x, spec, weights=ColumnWeights(h)).q,
        kernels.quantize_tensor(x, spec).q,
    )


def test_weights_that_do_not_fit_are_refused() -> None:
    x, _ = _data((4, 64))
    spec = _spec(Scheme.SYM, StorageDtype.INT4, PerGroup(32))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.quantize_tensor(x, spec, weights=ColumnWeights(torch.ones(1, 48)))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.quantize_tensor(x, spec, weights=ColumnWeights(torch.ones(3, 64)))


def test_fused_choice_runs_the_weighted_search_on_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """QTOOL_KERNEL=fused: a weighted search still gets the weighted codes (the fused kernels
    take no weights, so select.py hands it to the torch kernels)."""
    pytest.importorskip("numba")
    monkeypatch.setenv(select.ENV, "fused")
    x, h = _data((6, 128))
    spec = _spec(Scheme.SYM, StorageDtype.INT4, PerGroup(32))
    got = kernels.quantize_with(x, spec, weights=ColumnWeights(h))
    want = kernels.quantize_tensor(x, spec, weights=ColumnWeights(h))
    assert torch.equal(got.q, want.q)
    assert not torch.equal(got.q, kernels.quantize_with(x, spec).q)
