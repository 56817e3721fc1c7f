"""Error figures: ONE definition for every command and kernel (docs/numerics.md, "Error figures").

What is measured: the error of the weights exactly as a consumer reconstructs them. For a
quantized tensor, x_hat = (q - zero_point) * scale in float32, rounded to the dtype the tensor is
restored or loaded in (its own dtype: `qtool dequantize` restores it, transformers loads a
compressed-tensors export in it); e = x - x_hat in float32 (both sides upcast exactly; a float64
input counts at float32 precision). numel, sum e^2, sum x^2 and max |e| give mse = sum e^2 / n,
sqnr_db = 10 log10(sum x^2 / sum e^2) and max_abs.

How the sums are taken, so that every path gives the same digits (torch and fused kernels, tiny
tensors in a batch, the error budget, compare): squares are float64, which holds the square of a
float32 exactly. The tensor, seen as its [C, K] rows (spec.matrix_shape), is cut into chunks:
units of R = CHUNK // K whole rows when K <= CHUNK (one chunk each), else each row is a unit cut
into CHUNK-element chunks (the last shorter); the tensor's last unit may hold fewer rows. A chunk
is summed by folding in halves (zero-padded to a power of two P, v[i] += v[i + P/2] for
i < P/2, until one value is left; zeros add exactly, so any larger power of two gives the same
sum), and the chunk sums are added exactly (math.fsum: the correctly rounded sum, in any order).
A kernel computes each chunk's squares in whatever order it walks the tensor, but never a sum
across chunks, so the figures do not depend on the kernel, the thread count or the slab sizes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from qtool.results import ErrorStats
from qtool.spec import matrix_shape

CHUNK = 1024  # elements per chunk (fused_sums.CHUNK is the same; a test holds them equal)
CAP = 1 << 18  # values of each quantity folded at a time (2 MiB of float64, reused)
RESTORE_ROUNDED = (torch.bfloat16, torch.float16)  # dtypes x_hat is rounded to before measuring


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def unit_elems(shape: tuple[int, ...]) -> int:
    """Elements per unit: R = CHUNK // K whole rows of K, or one row when K > CHUNK."""
    _, k = matrix_shape(shape)
    if k == 0:
        return 1
    return k * (CHUNK // k) if k <= CHUNK else k


def chunk_count(shape: tuple[int, ...]) -> int:
    """How many chunks a tensor of `shape` has."""
    c, k = matrix_shape(shape)
    if k <= CHUNK:
        return -(-c * k // unit_elems(shape))
    return c * -(-k // CHUNK)


def chunk_spans(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, end) of every chunk of a tensor of `shape`, in flat (row-major) order."""
    c, k = matrix_shape(shape)
    n, unit = c * k, unit_elems(shape)
    if k <= CHUNK:
        return [(a, min(a + unit, n)) for a in range(0, n, unit)]
    return [(a, min(a + CHUNK, r + k)) for r in range(0, n, k) for a in range(r, r + k, CHUNK)]


def fold(buf: torch.Tensor) -> torch.Tensor:
    """Sums of the rows of VALUES [..., P] (float64, P a power of two): squared and folded in
    halves in place (x[i]^2 + x[i + P/2]^2 is exact up to its one rounding, fused or not)."""
    p = buf.shape[-1]
    if p == 1:
        return buf[..., 0].mul_(buf[..., 0])
    h = p // 2
    lo, hi = buf[..., :h], buf[..., h:p]
    lo.mul_(lo).addcmul_(hi, hi)
    return fold_sums(buf[..., :h])


def fold_sums(buf: torch.Tensor) -> torch.Tensor:
    """Sums of the rows of float64 [..., P] (P a power of two), folded in halves in place."""
    h = buf.shape[-1]
    while h > 1:
        q = h // 2
        buf[..., :q].add_(buf[..., q:h])
        h = q
    return buf[..., 0]


def exact_sum(partials: Sequence[float] | torch.Tensor) -> float:
    """The correctly rounded sum of the chunk sums (independent of their order)."""
    values = partials.tolist() if isinstance(partials, torch.Tensor) else partials
    return math.fsum(values)


def restore_(x_hat: torch.Tensor, dtype: torch.dtype, scratch: torch.Tensor | None = None) -> None:
    """Round a float32 reconstruction in place to `dtype` (bf16, fp16; others keep it as it is),
    the dtype the tensor is restored or loaded in. `scratch`: reused memory of that dtype."""
    if dtype not in RESTORE_ROUNDED:
        return
    if scratch is None or scratch.numel() < x_hat.numel():
        scratch = torch.empty(x_hat.numel(), dtype=dtype, device=x_hat.device)
    rounded = scratch[: x_hat.numel()].view(x_hat.shape)
    rounded.copy_(x_hat)
    x_hat.copy_(rounded)


class SquareSums:
    """sum v^2 of `count` quantities of one tensor (x and its error: one set of operations for
    both) by the canonical chunks, fed their values in flat order in runs of any length (each
    run continues the previous one)."""

    def __init__(
        self, shape: tuple[int, ...], device: torch.device | str = "cpu", count: int = 1
    ) -> None:
        self.unit = unit_elems(shape)
        self.device = torch.device(device)
        self.count = count
        self.pos = 0
        self.fill = 0  # values waiting in `carry` for the rest of their chunk
        self.carry = torch.empty(count, CHUNK, dtype=torch.float64, device=self.device)
        self.buf = torch.empty(0, dtype=torch.float64, device=self.device)
        self.sums = torch.empty(count, chunk_count(shape), dtype=torch.float64, device=self.device)
        self.done = 0  # chunks summed so far

    def add(self, *values: torch.Tensor) -> None:
        """One run of each quantity (the same elements of the tensor)."""
        vs = [v.reshape(-1) for v in values]
        n, i = vs[0].numel(), 0
        while i < n:
            o = self.pos % self.unit
            need = min(self.unit, (o // CHUNK + 1) * CHUNK) - o  # to the end of the chunk
            avail = n - i
            if self.fill or avail < need:
                take = min(need, avail)
                self._to_carry([v[i : i + take] for v in vs])
                if take == need:
                    self._flush()
            elif o == 0 and avail >= self.unit:
                m = max(1, min(avail // self.unit, CAP // self.unit))
                take = m * self.unit
                self._units([v[i : i + take].view(m, self.unit) for v in vs])
            else:  # whole chunks of a row longer than a chunk, then its last one
                full = min((self.unit - o) // CHUNK, avail // CHUNK, CAP // CHUNK)
                take = full * CHUNK if full else need
                self._chunks([v[i : i + take].view(-1, min(take, CHUNK)) for v in vs])
            i += take
            self.pos += take

    def totals(self) -> list[float]:
        """The exact sum of each quantity's chunk sums (the last, shorter unit included)."""
        self._flush()
        return [exact_sum(row) for row in self.sums[:, : self.done].cpu()]

    def _units(self, rows: list[torch.Tensor]) -> None:
        """m whole units [m, unit]: one chunk each, or rows in chunks (full ones, then a tail).
        The order of the slots is free: their sum is exact."""
        m, k = rows[0].shape
        full = k // CHUNK if k > CHUNK else 0
        if full:  # [m, full, CHUNK]: a view, whatever k
            self._chunks([r[:, : full * CHUNK].view(m, full, CHUNK) for r in rows])
        if k > full * CHUNK:
            self._chunks([r[:, full * CHUNK :] for r in rows])

    def _chunks(self, chunks: list[torch.Tensor]) -> None:
        """Sum chunks [..., L] (L <= CHUNK values each) of every quantity into the next slots."""
        *shape, length = chunks[0].shape
        lead, p = math.prod(shape), next_pow2(length)
        width = p if length == p else p // 2
        self.buf = _at_least(self.buf, self.count * lead * width)
        dst = self.buf[: self.count * lead * width].view(self.count, *shape, width)
        if length == p:
            for k, v in enumerate(chunks):
                dst[k].copy_(v)
            sums = fold(dst)
        else:
            sums = self._fold_padded(dst, chunks, p // 2)
        self.sums[:, self.done : self.done + lead].copy_(sums.reshape(self.count, lead))
        self.done += lead

    def _fold_padded(
        self, dst: torch.Tensor, chunks: list[torch.Tensor], half: int
    ) -> torch.Tensor:
        """fold() of chunks zero-padded to 2 * half, without writing the zeros: the first level
        is v[i]^2 + v[i + half]^2 where i + half < L, else v[i]^2 (adding 0^2 is exact). The
        upper values are squared in float64 (addcmul computes in the output's dtype)."""
        upper = chunks[0].shape[-1] - half
        for k, v in enumerate(chunks):
            lo = dst[k]
            lo.copy_(v[..., :half])
            lo.mul_(lo)
            hi = v[..., half:]
            lo[..., :upper].addcmul_(hi, hi)
        return fold_sums(dst)

    def _to_carry(self, values: list[torch.Tensor]) -> None:
        end = self.fill + values[0].numel()
        for k, v in enumerate(values):
            self.carry[k, self.fill : end].copy_(v)
        self.fill = end

    def _flush(self) -> None:
        if not self.fill:
            return
        p = next_pow2(self.fill)
        self.carry[:, self.fill : p].zero_()
        self.sums[:, self.done].copy_(fold(self.carry[:, :p]))
        self.done += 1
        self.fill = 0


class Measure:
    """The error figures of one tensor, fed (x, e = x - x_hat) in flat order, run by run."""

    def __init__(
        self, shape: tuple[int, ...], device: torch.device | str = "cpu", *, minmax: bool = False
    ) -> None:
        """`minmax`: also sum the squared error min-max would give (the mse search's report)."""
        self.numel = math.prod(shape)
        self._sums = SquareSums(shape, device, count=2)  # x and e
        self._minmax = SquareSums(shape, device) if minmax else None
        self._max_abs = 0.0

    @property
    def searching(self) -> bool:
        return self._minmax is not None

    def add_minmax(self, error: torch.Tensor) -> None:
        """The errors min-max would give, for the same run of elements as the next `add`."""
        assert self._minmax is not None
        self._minmax.add(error)

    def add(self, x: torch.Tensor, error: torch.Tensor) -> None:
        """x: the original values of the run (any float dtype); error: float32 (or float64)."""
        if error.numel() == 0:
            return
        lo, hi = torch.aminmax(error.reshape(-1))  # ~15x faster than vector_norm(inf) on CPU
        slab_max = float(torch.maximum(hi, lo.neg()))  # torch.maximum propagates NaN
        if math.isnan(slab_max) or math.isnan(self._max_abs):
            self._max_abs = math.nan  # sticky: a NaN must never look like a small error
        else:
            self._max_abs = max(self._max_abs, slab_max)
        self._sums.add(x, error)

    def result(self) -> ErrorStats:
        signal, error = self._sums.totals()
        return ErrorStats(
            numel=self.numel,
            sq_error=error,
            sq_signal=signal,
            max_abs=self._max_abs,
            sq_error_minmax=self._minmax.totals()[0] if self._minmax is not None else None,
        )


def error_stats(x: torch.Tensor, x_hat: torch.Tensor, block_elems: int = 1 << 20) -> ErrorStats:
    """Compare an original with its reconstruction as stored (both upcast to float32), slab by
    slab. When a float32 difference overflows (finite values of opposite sign near the float32
    limit), the tensor is measured again in float64, so finite inputs always give finite figures.
    """
    if x.shape != x_hat.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs {tuple(x_hat.shape)}")
    stats = _accumulate(x, x_hat, torch.float32, block_elems)
    if math.isinf(stats.max_abs) and _all_finite(x) and _all_finite(x_hat):
        stats = _accumulate(x, x_hat, torch.float64, block_elems)
    return stats


def _accumulate(
    x: torch.Tensor, x_hat: torch.Tensor, dtype: torch.dtype, block_elems: int
) -> ErrorStats:
    measure = Measure(tuple(x.shape), x.device)
    x1, y1 = x.reshape(-1), x_hat.reshape(-1)
    for start in range(0, x1.numel(), block_elems):
        xs = x1[start : start + block_elems].to(dtype)
        measure.add(xs, xs - y1[start : start + block_elems].to(dtype))
    return measure.result()


def tensor_sums(v: torch.Tensor, tensors: Sequence[tuple[int, tuple[int, ...]]]) -> list[float]:
    """sum v^2 of each of many small tensors stored one after another in the flat `v`, given as
    (offset, shape): the canonical chunks of all of them folded together, a few calls in all
    (the tiny tensors of a batch, engine/batch.py)."""
    spans: dict[int, list[tuple[int, int, int]]] = {}  # by padded width: (tensor, start, length)
    for t, (offset, shape) in enumerate(tensors):
        for a, b in _spans(shape):
            spans.setdefault(next_pow2(b - a), []).append((t, offset + a, b - a))
    flat = v.reshape(-1)
    padded = torch.cat([flat.to(torch.float64), flat.new_zeros(1, dtype=torch.float64)])
    per_tensor: list[list[float]] = [[] for _ in tensors]
    for width, chunks in spans.items():
        owner, start, length = (torch.tensor(c, device=v.device) for c in zip(*chunks, strict=True))
        cols = torch.arange(width, device=v.device)
        index = torch.where(cols < length[:, None], start[:, None] + cols, flat.numel())
        for t, value in zip(owner.tolist(), fold(padded[index]).tolist(), strict=True):
            per_tensor[t].append(value)
    return [exact_sum(values) for values in per_tensor]


@functools.lru_cache(maxsize=1024)
def _spans(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return chunk_spans(shape)


def _at_least(buf: torch.Tensor, n: int) -> torch.Tensor:
    """`buf`, or a larger buffer like it when it holds fewer than n values."""
    return buf if buf.numel() >= n else torch.empty(n, dtype=buf.dtype, device=buf.device)


def _all_finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


def count_nonfinite(t: torch.Tensor) -> int:
    """How many NaN/Inf values t holds (0 for integer tensors)."""
    return int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
