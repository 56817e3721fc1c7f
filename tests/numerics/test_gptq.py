from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.numerics import gptq as gptq_module
from qtool.numerics import kernels
from qtool.numerics.gptq import Fallback, Hessian, gptq_quantize, output_error
from qtool.numerics.packing import unpack_nibbles
from qtool.spec import (
    Granularity,
    PerChannel,
    PerGroup,
    PerTensor,
    QSpec,
    RangeMethod,
    Scheme,
    StorageDtype,
)
from tests import reference

GRIDS = [(s, d) for s in Scheme for d in StorageDtype]
GRID_IDS = [f"{s.value}-{d.value}" for s, d in GRIDS]


def _inputs(rows: int, k: int, seed: int, mix: float = 1.0) -> torch.Tensor:
    """Correlated input rows (rows, k): independent columns mixed by a random matrix, with
    columns of very different magnitudes (as a Linear's inputs have)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, k, generator=gen, dtype=torch.float64)
    mixing = (
        torch.eye(k, dtype=torch.float64)
        + mix * torch.randn(k, k, generator=gen, dtype=torch.float64) / k**0.5
    )
    magnitude = torch.exp(torch.randn(k, generator=gen, dtype=torch.float64))
    return torch.matmul(z, mixing).mul_(magnitude).float()


def _hessian(x: torch.Tensor) -> torch.Tensor:
    h = Hessian(x.shape[1])
    h.add(x)
    return h.matrix


def _weight(out: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1000)
    w = torch.randn(out, k, generator=gen) * 0.05
    w.view(-1)[:: max(1, w.numel() // 5)] *= 8  # outliers
    return w


def _spec(
    grid: tuple[Scheme, StorageDtype], g: Granularity, method: RangeMethod = RangeMethod.MINMAX
) -> QSpec:
    return QSpec(grid[0], grid[1], g, method)


def _ref_granularity(g: Granularity) -> tuple[str, int]:
    return ("group", g.size) if isinstance(g, PerGroup) else ("channel", 0)


def _rtn_codes(w: torch.Tensor, spec: QSpec) -> torch.Tensor:
    got = kernels.quantize_tensor(w, spec, with_errors=False)
    return unpack_nibbles(got.q, w.shape[1], spec.dtype.signed) if spec.dtype.packed else got.q


def _dequantized(
    result_codes: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, spec: QSpec
) -> torch.Tensor:
    """(q - zero_point) * scale with each column's own group, by hand."""
    q = result_codes
    out, k = q.shape
    grid_s = scale.float().reshape(out if scale.numel() > 1 else 1, -1)
    grid_z = zp.float().reshape(grid_s.shape)
    g = spec.granularity
    cols = torch.arange(k) // (min(g.size, k) if isinstance(g, PerGroup) else k)
    return (q.float() - grid_z[:, cols]) * grid_s[:, cols]


# ---- the textbook loop (tests/reference.py) gives the same codes ----


@pytest.mark.parametrize("grid", GRIDS, ids=GRID_IDS)
@pytest.mark.parametrize(
    ("granularity", "dynamic"),
    [(PerChannel(0), False), (PerGroup(16), False), (PerGroup(16), True), (PerGroup(12), True)],
    ids=["channel", "group16", "group16-dynamic", "group12-dynamic"],
)
@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_same_codes_as_the_textbook_loop(
    grid: tuple[Scheme, StorageDtype], granularity: Granularity, dynamic: bool, act_order: bool
) -> None:
    # K = 40: blocks of 16 cut groups of 12 and leave a short last block and group
    x = _inputs(400, 40, seed=1)
    h = _hessian(x)
    h[7, :] = 0.0
    h[:, 7] = 0.0  # a dead column
    w = _weight(12, 40, seed=2)
    spec = _spec(grid, granularity)
    got = gptq_quantize(
        w,
        h,
        spec,
        block_size=16,
        act_order=act_order,
        dynamic_groups=dynamic,
        compute_dtype=torch.float64,
    )
    codes, scales, zps = reference.gptq_codes(
        w.numpy(),
        h.numpy(),
        grid[0].value,
        grid[1].value,
        _ref_granularity(granularity),
        act_order=act_order,
        dynamic_groups=dynamic,
    )
    assert got.fallback is None and got.damp == 0.01
    np.testing.assert_array_equal(got.codes.numpy().astype(np.int64), codes)
    np.testing.assert_array_equal(got.scale.numpy().reshape(scales.shape), scales)
    np.testing.assert_array_equal(got.zero_point.numpy().astype(np.int64).reshape(zps.shape), zps)


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_same_codes_as_the_textbook_loop_past_one_inverse_leaf(act_order: bool) -> None:
    # K = 300: the triangular inverse splits (300 -> 150 -> 75) and blocks of 128 leave 44
    x = _inputs(1200, 300, seed=17)
    h = _hessian(x)
    w = _weight(10, 300, seed=18)
    spec = _spec((Scheme.ASYM, StorageDtype.INT4), PerGroup(32))
    got = gptq_quantize(w, h, spec, act_order=act_order, compute_dtype=torch.float64)
    codes, _, _ = reference.gptq_codes(
        w.numpy(), h.numpy(), "asym", "int4", ("group", 32), act_order=act_order
    )
    np.testing.assert_array_equal(got.codes.numpy().astype(np.int64), codes)


def test_float32_solve_agrees_with_float64() -> None:
    x = _inputs(2000, 96, seed=3)
    h = _hessian(x)
    w = _weight(32, 96, seed=4)
    spec = _spec((Scheme.SYM, StorageDtype.INT4), PerGroup(32))
    single = gptq_quantize(w, h, spec, block_size=32)
    double = gptq_quantize(w, h, spec, block_size=32, compute_dtype=torch.float64)
    e32 = output_error(_dequantized(single.codes, single.scale, single.zero_point, spec) - w, h)
    e64 = output_error(_dequantized(double.codes, double.scale, double.zero_point, spec) - w, h)
    assert abs(e32 - e64) <= 0.01 * e64


# ---- what it is for: a smaller output error than rounding ----


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    grid=st.sampled_from(GRIDS),
    group=st.sampled_from([0, 16, 32]),
    act_order=st.booleans(),
    dynamic=st.booleans(),
    mix=st.floats(1.0, 4.0),
)
def test_output_error_at_most_rounding_on_correlated_inputs(
    seed: int,
    grid: tuple[Scheme, StorageDtype],
    group: int,
    act_order: bool,
    dynamic: bool,
    mix: float,
) -> None:
    x = _inputs(512, 64, seed=seed, mix=mix)
    h = _hessian(x)
    w = _weight(16, 64, seed=seed)
    spec = _spec(grid, PerGroup(group) if group else PerChannel(0))
    got = gptq_quantize(w, h, spec, block_size=32, act_order=act_order, dynamic_groups=dynamic)
    rtn = kernels.quantize_tensor(w, spec, with_errors=False)
    rtn_w = kernels.dequantize(rtn.q, rtn.scale, rtn.zero_point, spec, shape=tuple(w.shape))
    gptq_w = kernels.dequantize(
        got.quantized(spec).q, got.scale, got.zero_point, spec, shape=tuple(w.shape)
    )
    assert output_error(gptq_w - w, h) <= output_error(rtn_w - w, h)


# ---- the special cases of the definition ----


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_dead_columns_get_the_zero_code_and_change_nothing_else(act_order: bool) -> None:
    x = _inputs(300, 24, seed=5)
    h = _hessian(x)
    w = _weight(8, 24, seed=6)
    spec = _spec((Scheme.ASYM, StorageDtype.UINT4), PerChannel(0))
    dead_h = torch.zeros(26, 26)
    cols = torch.tensor([c + (c >= 3) + (c >= 16) for c in range(24)])  # live columns in 26
    dead_h[cols[:, None], cols[None, :]] = h
    dead_w = torch.zeros(8, 26)
    dead_w[:, cols] = w
    dead_w[:, 3], dead_w[:, 17] = 5.0, -3.0  # large weights on inputs that are always zero
    with_dead = gptq_quantize(
        dead_w, dead_h, spec, block_size=8, act_order=act_order, compute_dtype=torch.float64
    )
    # the same lambda: dead columns count in mean(diag H) at H_jj = 1
    damp = 0.01 * float(dead_h.diagonal().sum() + 2) / 26 / float(h.diagonal().mean())
    without = gptq_quantize(
        w, h, spec, block_size=8, act_order=act_order, damp=damp, compute_dtype=torch.float64
    )
    zp = with_dead.zero_point[:, None]
    assert torch.equal(with_dead.codes[:, [3, 17]], zp.expand(8, 2))
    assert torch.equal(with_dead.codes[:, cols], without.codes)
    # the dead columns' weights do not widen the range: the qparams are those without them
    assert torch.equal(with_dead.scale, without.scale)


# every grid and granularity with min-max; the mse search, bf16 scales and dynamic groups on
# groups (they change nothing per channel or per tensor)
IDENTITY_CASES = [
    *[(grid, g, RangeMethod.MINMAX, torch.float32, False) for grid in GRIDS
      for g in (PerTensor(), PerChannel(0), PerGroup(16), PerGroup(10))],
    *[(grid, PerGroup(16), RangeMethod.MSE, torch.bfloat16, True) for grid in GRIDS],
    ((Scheme.ASYM, StorageDtype.UINT8), PerChannel(0), RangeMethod.MSE, torch.float32, False),
    ((Scheme.SYM, StorageDtype.INT4), PerGroup(10), RangeMethod.MINMAX, torch.bfloat16, True),
]  # fmt: skip


def test_identity_hessian_gives_round_to_nearest() -> None:
    # with nothing to compensate, GPTQ's codes are rounding's (dynamic groups: each group's
    # values are the original ones when it is reached)
    w = _weight(6, 40, seed=7).to(torch.bfloat16)
    for grid, g, method, scale_dtype, dynamic in IDENTITY_CASES:
        spec = _spec(grid, g, method)
        got = gptq_quantize(
            w, torch.eye(40), spec, block_size=16, scale_dtype=scale_dtype, dynamic_groups=dynamic
        )
        rtn = kernels.quantize_tensor(w, spec, with_errors=False, scale_dtype=scale_dtype)
        assert got.fallback is None
        assert torch.equal(got.quantized(spec).q, rtn.q), spec.describe()
        assert torch.equal(got.scale, rtn.scale) and got.scale.shape == rtn.scale.shape
        assert torch.equal(got.zero_point, rtn.zero_point)
        assert got.zero_point.dtype == rtn.zero_point.dtype


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_act_order_keeps_each_column_in_its_own_group(dynamic: bool) -> None:
    # diagonal H: no column's error moves another, so the codes are rounding's exactly, whatever
    # the order, if and only if each column is coded with the qparams of its own group
    gen = torch.Generator().manual_seed(8)
    diag = torch.rand(48, generator=gen) + 0.1
    w = _weight(5, 48, seed=9)
    w[:, 16:32] *= 100.0  # groups of very different magnitudes
    spec = _spec((Scheme.SYM, StorageDtype.INT4), PerGroup(16))
    got = gptq_quantize(
        w, torch.diag(diag), spec, block_size=8, act_order=True, dynamic_groups=dynamic
    )
    order = torch.argsort(diag, descending=True)
    assert set((order[:16] // 16).tolist()) == {0, 1, 2}  # the order mixes the groups
    assert torch.equal(got.codes, _rtn_codes(w, spec))
    assert torch.equal(got.scale, kernels.quantize_tensor(w, spec, with_errors=False).scale)


def test_a_failed_factorisation_raises_the_dampening() -> None:
    # diag (1, 1, 1, -0.5): mean 0.625; damp 0.01 and 0.1 leave -0.5 + lambda < 0, 1.0 does not
    h = torch.diag(torch.tensor([1.0, 1.0, 1.0, -0.5]))
    w = _weight(4, 4, seed=10)
    spec = _spec((Scheme.SYM, StorageDtype.INT8), PerChannel(0))
    got = gptq_quantize(w, h, spec)
    assert got.fallback is None and got.damp == pytest.approx(1.0)
    assert gptq_quantize(w, torch.eye(4), spec).damp == 0.01


@pytest.mark.parametrize(
    ("h", "why"),
    [
        (torch.tensor([[1.0, 100.0], [100.0, 1.0]]), Fallback.NOT_POSITIVE_DEFINITE),
        (torch.tensor([[1.0, float("nan")], [float("nan"), 1.0]]), Fallback.NONFINITE),
        (torch.zeros(2, 2), Fallback.NO_INPUT),
    ],
    ids=["indefinite", "nan", "zero"],
)
def test_falls_back_to_round_to_nearest_saying_why(h: torch.Tensor, why: Fallback) -> None:
    # eigenvalues 101 and -99: no dampening up to 1000 x 0.01 x mean diag (= 10) helps
    w = _weight(3, 2, seed=11)
    spec = _spec((Scheme.ASYM, StorageDtype.INT4), PerChannel(0))
    got = gptq_quantize(w, h, spec)
    assert got.fallback is why and got.damp is None
    assert torch.equal(got.codes, _rtn_codes(w, spec))


def test_an_indefinite_hessian_costs_four_factorisations(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    real = torch.linalg.cholesky_ex

    def counting(a: torch.Tensor, **kwargs: object) -> object:
        calls.append(float(a[0, 0]))
        return real(a, **kwargs)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", counting)
    h = torch.tensor([[1.0, 100.0], [100.0, 1.0]])
    got = gptq_quantize(
        _weight(3, 2, seed=21), h, _spec((Scheme.SYM, StorageDtype.INT8), PerChannel(0))
    )
    assert got.fallback is Fallback.NOT_POSITIVE_DEFINITE
    assert calls == pytest.approx([1.01, 1.1, 2.0, 11.0])  # lambda = 0.01, 0.1, 1, 10 x mean diag


def test_inputs_are_left_untouched() -> None:
    h = _hessian(_inputs(100, 16, seed=12))
    h[2, :] = h[:, 2] = 0.0
    w = _weight(4, 16, seed=13)
    h0, w0 = h.clone(), w.clone()
    gptq_quantize(w, h, _spec((Scheme.SYM, StorageDtype.INT8), PerGroup(8)))
    assert torch.equal(h, h0) and torch.equal(w, w0)


def test_refuses_what_it_cannot_solve() -> None:
    spec = _spec((Scheme.SYM, StorageDtype.INT8), PerChannel(0))
    with pytest.raises(ValueError, match="Hessian"):
        gptq_quantize(torch.ones(2, 3), torch.eye(2), spec)
    with pytest.raises(ValueError, match="axis 0"):
        gptq_quantize(
            torch.ones(2, 3), torch.eye(3), _spec((Scheme.SYM, StorageDtype.INT8), PerChannel(1))
        )
    with pytest.raises(ValueError, match="damp"):
        gptq_quantize(torch.ones(2, 3), torch.eye(3), spec, damp=0.0)
    with pytest.raises(ValueError, match="non-empty"):
        gptq_quantize(torch.ones(3), torch.eye(3), spec)


# ---- the stored form ----


@pytest.mark.parametrize("grid", GRIDS, ids=GRID_IDS)
def test_stored_codes_dequantize_as_any_quantized_tensor(grid: tuple[Scheme, StorageDtype]) -> None:
    x = _inputs(200, 21, seed=14)  # odd K: 4-bit rows end in a padded byte
    w = _weight(6, 21, seed=15)
    spec = _spec(grid, PerGroup(8))
    got = gptq_quantize(w, _hessian(x), spec, block_size=8)
    stored = got.quantized(spec)
    restored = kernels.dequantize(stored.q, stored.scale, stored.zero_point, spec, shape=(6, 21))
    assert torch.equal(restored, _dequantized(got.codes, got.scale, got.zero_point, spec))
    assert got.codes.dtype == kernels.TORCH_STORAGE[spec.dtype]
    assert int(got.codes.min()) >= spec.qmin and int(got.codes.max()) <= spec.qmax


# ---- the Hessian ----


def test_output_error_is_the_trace_of_dw_h_dwt() -> None:
    x = _inputs(300, 40, seed=19)
    h = _hessian(x)
    d = _weight(7, 40, seed=20)
    exact = float(torch.trace(d.double() @ h.double() @ d.double().T))
    assert output_error(d, h) == pytest.approx(exact, rel=1e-5)
    # n / 2 of it is the summed squared error of the Linear's outputs on those rows
    assert output_error(d, h) * 300 / 2 == pytest.approx(float(((x @ d.T) ** 2).sum()), rel=1e-4)


def test_hessian_is_two_over_n_sum_x_xt_in_any_chunks_and_merges() -> None:
    x = _inputs(300, 12, seed=16)
    exact = 2.0 / 300 * x.double().T @ x.double()
    h = Hessian(12)
    for chunk in (x[:7], x[7:100].reshape(3, 31, 12), x[100:]):
        h.add(chunk)
    assert h.rows == 300
    torch.testing.assert_close(h.matrix.double(), exact, rtol=1e-6, atol=1e-6)
    a, b = Hessian(12), Hessian(12, dtype=torch.float64)
    a.add(x[:120])
    b.add(x[120:])
    merged = a.merge(b)
    assert merged.rows == 300
    torch.testing.assert_close(merged.matrix.double(), exact, rtol=1e-6, atol=1e-6)
    assert torch.equal(Hessian(3).matrix, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="width 12"):
        h.add(torch.ones(4, 5))
    with pytest.raises(ValueError, match="merge"):
        h.merge(Hessian(5))


@pytest.mark.parametrize(("k", "bands"), [(576, 8), (1536, 8), (64, 2), (7, 1)])
def test_the_hessian_sums_its_upper_triangle_only_and_mirrors_the_whole_product(
    k: int, bands: int
) -> None:
    """The accumulation does 9/16 of x^T x's multiply-adds at SmolLM2's widths (eight row
    bands, each from its own columns on; all of them before), and what it reads is the whole
    product's, bit for bit (each entry the same dot product over the same rows), down to one
    band for a narrow input."""
    gen = torch.Generator().manual_seed(k)
    windows = [torch.randn(512, k, generator=gen) * torch.rand(k, generator=gen) for _ in "ab"]
    products: list[int] = []
    addmm = torch.Tensor.addmm_

    def counted(self: torch.Tensor, a: torch.Tensor, b: torch.Tensor, **kw: Any) -> Any:
        products.append(a.shape[0] * a.shape[1] * b.shape[1])
        return addmm(self, a, b, **kw)

    h = Hessian(k)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "addmm_", counted)
        for x in windows:
            h.add(x)
    whole = 512 * k * k * len(windows)
    assert len(products) == bands * len(windows)
    assert sum(products) == sum(
        512 * (k * (a + 1) // bands - k * a // bands) * (k - k * a // bands) for a in range(bands)
    ) * len(windows)
    assert sum(products) <= whole * (0.5 + 0.5 / bands) + 512 * k * len(windows)
    summed = torch.zeros(k, k)
    for x in windows:
        summed.addmm_(x.T, x)
    assert torch.equal(h.sum, summed)
    assert torch.equal(h.matrix, summed * (2.0 / 1024))


def test_an_inverse_overflowing_float32_tries_the_larger_dampening(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a factorisation that succeeds but whose inverse is not finite is not the end of the
    # dampening ladder (it was reported as 'not positive definite' at the first damp)
    real = gptq_module._lower_inverse
    calls: list[int] = []

    def overflowing_once(lower: torch.Tensor, out: torch.Tensor) -> None:
        real(lower, out)
        if not calls:
            out[-1, 0] = float("inf")
        calls.append(1)

    monkeypatch.setattr(gptq_module, "_lower_inverse", overflowing_once)
    w = _weight(8, 64, seed=22)
    spec = _spec((Scheme.SYM, StorageDtype.INT8), PerChannel(0))
    got = gptq_quantize(w, _hessian(_inputs(256, 64, seed=22)), spec)
    assert got.fallback is None and len(calls) == 2
    assert got.damp == pytest.approx(0.1)


def test_a_hessian_handed_over_is_let_go_before_the_column_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A caller that keeps no reference (methods/gptq.GptqPolicy) gets the Hessian's memory
    back once it is factorised: the column loop and what follows run without it."""
    import weakref

    alive: list[bool] = []
    run = gptq_module._Solver.run

    def spy(self: Any, u: torch.Tensor, block_size: int) -> torch.Tensor:
        alive.append(handed() is not None)
        return run(self, u, block_size)

    monkeypatch.setattr(gptq_module._Solver, "run", spy)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    box = [(2.0 / 64) * (x.T @ x)]
    handed = weakref.ref(box[0])
    spec = _spec((Scheme.SYM, StorageDtype.INT4), PerGroup(8))
    gptq_quantize(_weight(4, 16, 0), box.pop(), spec)
    assert alive == [False]
