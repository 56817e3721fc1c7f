"""GPTQ (docs/numerics.md, "GPTQ"): a Linear's codes chosen column by column so that the error of
the columns already rounded is compensated in the others, with H = (2 / n) sum x x^T of its inputs.

Pure torch on the tensors given; no I/O. The qparams are the integer grid's own (the range method
of the spec, chosen from the weights before the loop, or per group at its first column with
`dynamic_groups`), so the result is stored as any round-to-nearest tensor is: no g_idx.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from qtool.numerics.kernels import TORCH_STORAGE, QuantizedTensor, quantize_tensor
from qtool.numerics.packing import pack_nibbles, unpack_nibbles
from qtool.numerics.range_methods import range_method
from qtool.numerics.views import normalize_spec
from qtool.spec import PerChannel, PerGroup, QSpec

DAMP_RAISES = 3  # dampening tried at damp, x10, x100, x1000 before rounding to nearest


HESSIAN_BANDS, BAND_COLUMNS = 8, 32
"""Row bands of a Hessian's accumulation (at most 8, at least 32 columns each): band a adds
x_a^T x[:, a:] (its columns from its own on), the upper triangle and the diagonal blocks, 9/16
of the products of the whole x^T x with 8 bands (SmolLM2 at K = 1,536 and 512 rows, one CPU
thread: 27 -> 18 ms; K = 576: 3.7 -> 2.4 ms). Each entry is the same dot product over the same
rows as the whole product's, which is symmetric, so the mirrored sum is the whole product's bit
for bit on the CPU (MKL: checked for K of 64 to 4,096 and 32 to 2,048 rows). Narrower bands
took other kernels (K = 7 in bands of one column differed in the last bit, and its whole
product was not symmetric): below 64 columns one band, read as summed."""


class Hessian:
    """Running H = (2 / n) sum x x^T over the n input rows x (K columns) of one Linear.

    The sum is kept unscaled (float32 by default) and scaled once when read, so adding rows
    never rescales what was summed before. Only its upper triangle is accumulated
    (HESSIAN_BANDS) and mirrored when read.
    """

    def __init__(
        self,
        columns: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if columns < 1:
            raise ValueError(f"a Hessian needs at least one column, got {columns}")
        self._upper = torch.zeros(columns, columns, dtype=dtype, device=device)
        self._bands = max(1, min(HESSIAN_BANDS, columns // BAND_COLUMNS))
        self.rows = 0

    @property
    def columns(self) -> int:
        return self._upper.shape[0]

    def add(self, x: torch.Tensor) -> None:
        """Add the rows of x (..., K): sum += x^T x, rows += x.numel() / K."""
        if x.shape[-1:] != (self.columns,):
            raise ValueError(f"inputs of width {self.columns} expected, got {tuple(x.shape)}")
        rows = x.reshape(-1, self.columns).to(device=self._upper.device, dtype=self._upper.dtype)
        k, bands = self.columns, self._bands
        for a in range(bands):
            lo, hi = k * a // bands, k * (a + 1) // bands
            self._upper[lo:hi, lo:].addmm_(rows[:, lo:hi].T, rows[:, lo:])
        self.rows += rows.shape[0]

    @property
    def sum(self) -> torch.Tensor:
        """sum x x^T (K, K), unscaled, in the accumulation dtype."""
        if self._bands == 1:  # summed whole
            return self._upper
        k = self.columns
        upper = torch.ones(k, k, dtype=torch.bool, device=self._upper.device).triu_()
        return torch.where(upper, self._upper, self._upper.T)

    @property
    def matrix(self) -> torch.Tensor:
        """(2 / n) sum x x^T as float32 (K, K); all zeros before any row was added."""
        if self.rows == 0:
            return torch.zeros_like(self._upper, dtype=torch.float32)
        return (self.sum * (2.0 / self.rows)).float()

    def merge(self, other: Hessian) -> Hessian:
        """The Hessian of both sets of rows (sums and counts added), on this one's device."""
        if other.columns != self.columns:
            raise ValueError(f"cannot merge Hessians of {self.columns} and {other.columns} columns")
        merged = Hessian(self.columns, device=self._upper.device, dtype=self._upper.dtype)
        torch.add(self._upper, other._upper.to(self._upper), out=merged._upper)
        merged.rows = self.rows + other.rows
        return merged


class Fallback(str, enum.Enum):
    """Why a Linear was rounded to nearest instead (its value is the table's wording)."""

    NOT_POSITIVE_DEFINITE = "Hessian not positive definite even with the largest dampening"
    NONFINITE = "Hessian holds NaN or Inf"
    NO_INPUT = "Hessian is zero (no calibration input reached this Linear)"


@dataclass(frozen=True)
class GPTQResult:
    """Codes (out, K) unpacked in the storage dtype, original column order; scale and zero
    point exactly as kernels.quantize_tensor gives them for the spec (scale float32 holding
    values of the scale dtype, zero point in the storage dtype, the qparam shape)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    damp: float | None  # the dampening fraction that factorised; None when rounded to nearest
    fallback: Fallback | None  # why it was rounded to nearest, None for GPTQ codes

    def quantized(self, spec: QSpec) -> QuantizedTensor:
        """The codes as stored (4-bit packed two per byte, an odd row padded with the code of
        0.0), for the writer; no error figures."""
        q = self.codes
        if spec.dtype.packed:
            zp = self.zero_point  # per tensor (), per channel (out,), per group (out, groups)
            pad = zp if zp.ndim == 0 else zp.reshape(q.shape[0], -1)[:, -1:]
            q = pack_nibbles(q, spec.dtype.signed, pad)
        return QuantizedTensor(q=q, scale=self.scale, zero_point=self.zero_point, errors=None)


def output_error(delta: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(dW H dW^T): the squared output error of a weight change dW (out, K) summed over the
    rows H was built from, times 2 / n. The product dW H in float32 (no float64 copy of H: 1.6 GB
    at K = 14,336), its elementwise product with dW summed in float64."""
    d = delta.float()
    return float(torch.sum((d @ hessian.float()).mul_(d), dtype=torch.float64))


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: QSpec,
    *,
    block_size: int = 128,
    act_order: bool = True,
    damp: float = 0.01,
    scale_dtype: torch.dtype = torch.float32,
    dynamic_groups: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> GPTQResult:
    """GPTQ codes of weight (out, K) for an integer `spec` (per tensor, channel on axis 0 or
    group), as docs/numerics.md ("GPTQ") defines them. `dynamic_groups`: each group's qparams
    from its error-updated weights when its first column is reached (GPTQModel), instead of
    from the weights before the loop. `compute_dtype` float64 only for tests and measurements."""
    spec = _check(weight, hessian, spec, block_size, damp, compute_dtype)
    hessian = hessian.to(weight.device)  # the solve runs where the weight is
    if not _finite(hessian):
        return _rounded(weight, spec, scale_dtype, Fallback.NONFINITE)
    dead = hessian.diagonal() == 0
    if bool(dead.all()):
        return _rounded(weight, spec, scale_dtype, Fallback.NO_INPUT)
    # decreasing diag H, dead columns last, ties in column order
    order = torch.argsort(hessian.diagonal(), descending=True, stable=True) if act_order else None
    w = weight.to(torch.float32, copy=True)
    w[:, dead] = 0.0
    rtn = quantize_tensor(w, spec, with_errors=False, scale_dtype=scale_dtype)
    factor = _inverse_factor(hessian, order, dead, damp, compute_dtype)
    if factor is None:
        return _rounded(weight, spec, scale_dtype, Fallback.NOT_POSITIVE_DEFINITE)
    u, used = factor
    del hessian, factor  # a caller that handed it over has its memory back for the loop
    solver = _Solver(w, spec, rtn, order, scale_dtype, dynamic_groups, compute_dtype)
    del w
    codes = solver.run(u, block_size)
    scale, zero_point = solver.qparams(rtn)
    return GPTQResult(codes, scale, zero_point, used, None)


def unsupported(spec: QSpec) -> str | None:
    """Why GPTQ cannot choose the codes of a 2-D weight on this grid (None: it can). Channels on
    axis 1 put one scale on each input column, which the column-by-column update would have
    to re-derive as it goes."""
    spec = normalize_spec(spec, 2)
    if isinstance(spec.granularity, PerChannel) and spec.granularity.axis != 0:
        return (
            "GPTQ quantizes per tensor, per output channel (axis 0) or per group, "
            "not per input column (axis 1)"
        )
    return None


def _check(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: QSpec,
    block_size: int,
    damp: float,
    compute_dtype: torch.dtype,
) -> QSpec:
    if weight.ndim != 2 or weight.numel() == 0:
        raise ValueError(f"GPTQ quantizes a non-empty (out, K) weight, got {tuple(weight.shape)}")
    k = weight.shape[1]
    if tuple(hessian.shape) != (k, k):
        raise ValueError(
            f"the Hessian of a weight with {k} columns is ({k}, {k}), got {tuple(hessian.shape)}"
        )
    if not isinstance(spec, QSpec):
        raise ValueError(f"GPTQ takes an integer grid, not {spec.describe()}")
    spec = normalize_spec(spec, 2)
    why = unsupported(spec)
    if why is not None:
        raise ValueError(why)
    if block_size < 1 or not damp > 0 or damp == float("inf"):
        raise ValueError(f"block_size must be >= 1 and damp positive, got {block_size}, {damp}")
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"GPTQ computes in float32 or float64, not {compute_dtype}")
    return spec


def _inverse_factor(
    hessian: torch.Tensor,
    order: torch.Tensor | None,
    dead: torch.Tensor,
    damp: float,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, float] | None:
    """(U, damp used): U upper triangular with U^T U = (H + lambda I)^-1 in processing order,
    lambda = damp x mean diag H (dead columns at H_jj = 1), damp raised x10 up to DAMP_RAISES
    times while the Cholesky factorisation fails or the inverse overflows; None if every one
    does.

    With J the reversal, J (H + lambda I) J = L L^T gives H + lambda I = R R^T, R = J L J upper,
    so (H + lambda I)^-1 = R^-T R^-1 and U = R^-1 = J L^-1 J (the upper Cholesky factor of the
    inverse, positive diagonal, hence unique): one factorisation and one triangular solve, the
    inverse never formed."""
    k = hessian.shape[0]
    rev = torch.arange(k - 1, -1, -1, device=hessian.device) if order is None else order.flip(0)
    hr: torch.Tensor | None = _reordered(hessian, order, rev, compute_dtype)
    assert hr is not None
    base = hr.diagonal().masked_fill_(dead[rev], 1.0).clone()
    mean = float(base.mean())
    for attempt in range(DAMP_RAISES + 1):
        frac = damp * 10.0**attempt
        if hr is None:  # the last try's inverse overflowed in its place
            hr = _reordered(hessian, order, rev, compute_dtype)
        torch.add(base, frac * mean, out=hr.diagonal())
        lower, info = torch.linalg.cholesky_ex(hr)
        if int(info) != 0:
            continue
        _lower_inverse(lower, hr)  # H's copy is spent: the inverse takes its memory
        del lower
        if _finite(hr):  # an inverse overflowing float32 tries the next, larger dampening
            return hr.flip(0, 1), frac
        hr = None
    return None


def _reordered(
    hessian: torch.Tensor, order: torch.Tensor | None, rev: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """H in the reversed processing order `rev`, one (K, K) copy in `dtype`."""
    if order is None:
        return hessian.flip(0, 1).to(dtype)
    return hessian[rev[:, None], rev[None, :]].to(dtype)


def _lower_inverse(lower: torch.Tensor, out: torch.Tensor) -> None:
    """out = lower^-1 for a lower triangular matrix, by halves: [[A, 0], [C, D]]^-1 =
    [[A^-1, 0], [-D^-1 C A^-1, D^-1]] (matrix products: 2.4x faster than a triangular solve
    against the identity on one CPU thread at K = 1536)."""
    n = lower.shape[0]
    if n <= 128:
        eye = torch.eye(n, dtype=lower.dtype, device=lower.device)
        out.copy_(torch.linalg.solve_triangular(lower, eye, upper=False))
        return
    m = n // 2
    _lower_inverse(lower[:m, :m], out[:m, :m])
    _lower_inverse(lower[m:, m:], out[m:, m:])
    out[:m, m:] = 0.0
    out[m:, :m] = (out[m:, m:] @ (lower[m:, :m] @ out[:m, :m])).neg_()


def _finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in t (two reductions that propagate NaN, no boolean temporary)."""
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _rounded(
    weight: torch.Tensor, spec: QSpec, scale_dtype: torch.dtype, why: Fallback
) -> GPTQResult:
    """Round to nearest, exactly the codes the data-free quantizer gives the same weight."""
    rtn = quantize_tensor(weight, spec, with_errors=False, scale_dtype=scale_dtype)
    codes = rtn.q
    if spec.dtype.packed:
        codes = unpack_nibbles(codes, weight.shape[1], spec.dtype.signed)
    return GPTQResult(codes, rtn.scale, rtn.zero_point, None, why)


def _codes(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QSpec
) -> torch.Tensor:
    """clamp(round(x / scale) + zero_point, qmin, qmax) as floats (a division, half to even)."""
    return torch.div(x, scale).round_().add_(zero_point).clamp_(spec.qmin, spec.qmax)


class _Solver:
    """The column loop in processing order (act-order's permutation, or none): blocks of
    `block_size` columns, updates inside a block applied column by column, those for the columns
    after it once per block (the lazy batch update of the GPTQ paper, section 3.4). The weight
    is held transposed, (K, out), so each column and each update is contiguous memory."""

    def __init__(
        self,
        w: torch.Tensor,
        spec: QSpec,
        rtn: QuantizedTensor,
        order: torch.Tensor | None,
        scale_dtype: torch.dtype,
        dynamic: bool,
        compute_dtype: torch.dtype,
    ) -> None:
        out, k = w.shape
        self.spec, self.k = spec, k
        self.order = order if order is not None else torch.arange(k, device=w.device)
        self.wt = (w[:, order] if order is not None else w).T.to(compute_dtype).contiguous()
        # qparams as (groups, rows or 1) grids: group g's are row g; original column c's group
        # is c // size
        rows = out if rtn.scale.numel() > 1 else 1
        self.scale = rtn.scale.reshape(rows, -1).T.to(compute_dtype).contiguous()
        self.zero_point = rtn.zero_point.reshape(rows, -1).T.to(compute_dtype).contiguous()
        g = spec.granularity
        self.size = min(g.size, k) if isinstance(g, PerGroup) else k
        self.group = (self.order // self.size).tolist()
        self.dynamic = dynamic and isinstance(g, PerGroup) and g.size < k
        self.ranger = range_method(spec, (out, k), scale_dtype, 1 << 21)
        self.seen: set[int] = set()
        self.position = torch.argsort(self.order)  # original column -> processing position
        self.err = self.wt[:0]

    def run(self, u: torch.Tensor, block_size: int) -> torch.Tensor:
        """The codes (out, K) in the storage dtype, original column order."""
        wt, k = self.wt, self.k
        codes = torch.empty(wt.shape, dtype=TORCH_STORAGE[self.spec.dtype], device=wt.device)
        for i1 in range(0, k, block_size):
            i2 = min(i1 + block_size, k)
            q1 = self._block(u, i1, i2)
            codes[self.order[i1:i2]] = q1.to(codes.dtype)
            if i2 < k:
                wt[i2:].addmm_(u[i1:i2, i2:].T, self.err, alpha=-1.0)
        return codes.T.contiguous()

    def qparams(self, rtn: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """scale and zero point in the shapes and dtypes of the round-to-nearest result."""
        scale = self.scale.T.float().reshape(rtn.scale.shape).contiguous()
        zero_point = self.zero_point.T.to(rtn.zero_point.dtype).reshape(rtn.zero_point.shape)
        return scale, zero_point.contiguous()

    def _block(self, u: torch.Tensor, i1: int, i2: int) -> torch.Tensor:
        """Codes (as floats, (i2 - i1, out)) of columns [i1, i2); their errors divided by
        U's diagonal kept in self.err for the update of the columns after the block."""
        w1, u1 = self.wt[i1:i2], u[i1:i2, i1:i2]
        q1 = torch.empty_like(w1)
        self.err = torch.empty_like(w1)
        qmin, qmax = self.spec.qmin, self.spec.qmax
        for i in range(i2 - i1):
            g = self.group[i1 + i]
            if self.dynamic and g not in self.seen:
                self._choose_group(g, u, i1, i)
                self.seen.add(g)
            s, z, col, q, e = self.scale[g], self.zero_point[g], w1[i], q1[i], self.err[i]
            torch.div(col, s, out=q).round_().add_(z).clamp_(qmin, qmax)  # the codes
            torch.sub(q, z, out=e).mul_(s)  # the column as dequantized
            torch.sub(col, e, out=e).div_(u1[i, i])
            if i + 1 < i2 - i1:
                w1[i + 1 :].addr_(u1[i, i + 1 :], e, alpha=-1.0)
        return q1

    def _choose_group(self, g: int, u: torch.Tensor, i1: int, i: int) -> None:
        """qparams of group g from its columns' current values: those in this block are up to
        date, those after it still owe this block's updates so far (err of columns i1..i1+i)."""
        cols = torch.arange(g * self.size, min((g + 1) * self.size, self.k), device=u.device)
        pos = self.position[cols]  # in original column order
        values = self.wt[pos]  # (L, out)
        late = pos >= i1 + self.err.shape[0]
        if i and bool(late.any()):
            values[late] -= u[i1 : i1 + i][:, pos[late]].T @ self.err[:i]
        scale, zero_point, _ = self.ranger.groups(values.T.float().contiguous().unsqueeze(1))
        self.scale[g] = scale[:, 0]
        self.zero_point[g] = zero_point[:, 0]
