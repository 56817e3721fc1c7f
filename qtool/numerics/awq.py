"""AWQ numerics (docs/numerics.md, "AWQ"): per-input-channel scales s from activation and weight
magnitudes, searched on a block's output error, and folded into the operation before the Linears
so the model computes the same function with weights that quantize better.

Pure torch on the tensors and modules given; no I/O. The search runs a caller's loss (the
block's forward pass) through `search`; this module never runs a model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from qtool.numerics.kernels import dequantize, quantize_tensor
from qtool.numerics.views import group_parts, normalize_spec, part_view
from qtool.spec import PerChannel, PerTensor, QSpec

N_GRID = 20  # llm-compressor's default: the identity and 19 exponents 0, 1/18, .., 1
W_EPS = 1e-6  # added to each group's max |w| before dividing by it
DUO_EPS = 1e-4  # added to w_mean^(1 - alpha); also the floor of every scale


class NonFiniteLoss(ValueError):
    """Every candidate of the search gave a NaN or infinite loss."""


class AbsMean:
    """Running mean of |x| per input column over the rows x (K columns) of a Linear's input
    (float64 sums, read as float32)."""

    def __init__(self, columns: int, *, device: torch.device | str | None = None) -> None:
        self.sum = torch.zeros(columns, dtype=torch.float64, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        """Add the rows of x (..., K)."""
        if x.shape[-1:] != self.sum.shape:
            raise ValueError(f"inputs of width {self.sum.shape[0]} expected, got {tuple(x.shape)}")
        rows = x.reshape(-1, x.shape[-1])
        self.sum += rows.abs().sum(dim=0, dtype=torch.float64).to(self.sum.device)
        self.rows += rows.shape[0]

    @property
    def mean(self) -> torch.Tensor:
        """E|x_j| as float32 (K,); ValueError before any row."""
        if self.rows == 0:
            raise ValueError("no input rows were added")
        return (self.sum / self.rows).float()

    def merge(self, other: AbsMean) -> AbsMean:
        """The mean over both sets of rows."""
        if other.sum.shape != self.sum.shape:
            raise ValueError("cannot merge means of different widths")
        merged = AbsMean(self.sum.shape[0], device=self.sum.device)
        merged.sum = self.sum + other.sum.to(self.sum.device)
        merged.rows = self.rows + other.rows
        return merged


def weight_means(weights: Sequence[torch.Tensor], spec: QSpec) -> torch.Tensor:
    """w_mean (K,) float32: over every row of every weight (out_i, K), the mean of
    |W_rj| / (max |W| over the quantization group holding (r, j) + W_EPS)."""
    g = normalize_spec(spec, 2).granularity
    if isinstance(g, PerChannel) and g.axis != 0:
        raise ValueError("AWQ balances Linears quantized per tensor, per output channel or group")
    total = torch.zeros(weights[0].shape[1], dtype=torch.float64, device=weights[0].device)
    rows = 0
    for w in weights:
        if w.ndim != 2 or w.shape[1] != total.shape[0]:
            raise ValueError(
                f"weights of {total.shape[0]} input columns expected, got {tuple(w.shape)}"
            )
        a = w.detach().float().abs()  # (out, K), normalised in place
        if isinstance(g, PerTensor):
            a.div_(a.amax() + W_EPS)
        elif isinstance(g, PerChannel):
            a.div_(a.amax(dim=1, keepdim=True) + W_EPS)
        else:
            length = min(g.size, a.shape[1])
            for part, _ in group_parts(a.shape[1], length):
                view = part_view(a, part, length)  # (out, groups, L)
                view.div_(view.amax(dim=2, keepdim=True) + W_EPS)
        total += a.sum(dim=0, dtype=torch.float64)
        rows += a.shape[0]
    return (total / rows).float()


def grid(n_grid: int = N_GRID, duo_scaling: bool = True) -> list[tuple[float, bool]]:
    """The (alpha, duo) candidates in search order, as llm-compressor's AWQModifier: with duo
    scaling the identity (0, False) first, then alpha = i / (n_grid - 2), i < n_grid - 1; without,
    alpha = i / (n_grid - 1), i < n_grid (alpha = 0 is the identity)."""
    if n_grid < 3:
        raise ValueError(f"the grid needs at least 3 points, got {n_grid}")
    if duo_scaling:
        return [(0.0, False)] + [(i / (n_grid - 2), True) for i in range(n_grid - 1)]
    return [(i / (n_grid - 1), False) for i in range(n_grid)]


def scales_for(
    x_mean: torch.Tensor, w_mean: torch.Tensor | None, alpha: float, duo: bool
) -> torch.Tensor:
    """s = max(x_mean^alpha / (w_mean^(1 - alpha) + 1e-4), 1e-4) with duo scaling, else
    max(x_mean^alpha, 1e-4); then s / sqrt(max s * min s) (the geometric middle of the range at
    1); a NaN or infinite s_j is 1."""
    s = x_mean.float().pow(alpha)
    if duo:
        if w_mean is None:
            raise ValueError("duo scaling needs the weight means")
        s = s / (w_mean.float().pow(1.0 - alpha) + DUO_EPS)
    s = s.clamp(min=DUO_EPS)
    s = s / (s.max() * s.min()).sqrt()
    return s.masked_fill_(~torch.isfinite(s), 1.0)


@dataclass(frozen=True)
class AwqChoice:
    """The search's result: the scales of the best candidate and what every candidate cost."""

    scales: torch.Tensor  # float32 (K,)
    alpha: float
    duo: bool
    loss: float  # the best loss
    identity_loss: float  # the loss of the first candidate (the identity, s = 1)
    losses: tuple[float, ...]  # every candidate's, in grid order


def search(
    loss: Callable[[torch.Tensor], float],
    x_mean: torch.Tensor,
    w_mean: torch.Tensor | None,
    candidates: Sequence[tuple[float, bool]] | None = None,
) -> AwqChoice:
    """The candidate whose scales give the smallest `loss(scales)` (a strictly smaller loss
    replaces the best, so ties keep the earlier one; NaN never wins); NonFiniteLoss if none is
    finite. `loss` is the caller's: typically the block's output error with every balanced
    Linear's weight replaced by quantized_scaled(W, s, spec)."""
    candidates = list(candidates) if candidates is not None else grid()
    losses: list[float] = []
    best: tuple[float, int, torch.Tensor] | None = None
    for k, (alpha, duo) in enumerate(candidates):
        s = scales_for(x_mean, w_mean, alpha, duo)
        value = float(loss(s))
        losses.append(value)
        if math.isfinite(value) and (best is None or value < best[0]):
            best = (value, k, s)
    if best is None:
        raise NonFiniteLoss("every scale candidate gave a NaN or infinite output error")
    value, k, s = best
    alpha, duo = candidates[k]
    return AwqChoice(s, alpha, duo, value, losses[0], tuple(losses))


def quantized_scaled(
    weight: torch.Tensor,
    scales: torch.Tensor,
    spec: QSpec,
    scale_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Q(W diag(s)) diag(s)^-1 in float32 (out, K): the weight a Linear acts with once its
    input columns are scaled by s, quantized with `spec`, and s is divided out of its input."""
    s = scales.to(device=weight.device, dtype=torch.float32)
    scaled = weight.float() * s
    q = quantize_tensor(scaled, spec, with_errors=False, scale_dtype=scale_dtype)
    return dequantize(q.q, q.scale, q.zero_point, spec, shape=tuple(scaled.shape)).div_(s)


@torch.no_grad()
def scale_inputs(linears: Sequence[torch.nn.Linear], scales: torch.Tensor) -> None:
    """W[:, j] *= s_j for every Linear (in float32, stored back in the weight's dtype)."""
    for linear in linears:
        _check_width(linear.weight.shape[1], scales, f"{type(linear).__name__} input")
        w = linear.weight
        w.copy_(w.float() * scales.to(w.device))


@torch.no_grad()
def fold_into_linear(previous: torch.nn.Linear, scales: torch.Tensor) -> None:
    """Divide s out of the output rows of the Linear before (v_proj for o_proj, up_proj for
    down_proj): W[j, :] /= s_j and b_j /= s_j."""
    _check_width(previous.weight.shape[0], scales, "previous Linear output")
    w = previous.weight
    w.copy_(w.float() / scales.to(w.device)[:, None])
    if previous.bias is not None:
        b = previous.bias
        b.copy_(b.float() / scales.to(b.device))


@torch.no_grad()
def fold_into_norm(norm: torch.nn.Module, scales: torch.Tensor) -> None:
    """Divide s out of a norm whose output is weight * normalized(x) (+ bias): RMSNorm, LayerNorm.
    Checked on a probe input: a norm whose output does not scale by 1/s after the division (one
    computing (1 + weight) * ..., as Gemma's) is left as it was and refused (ValueError)."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1:
        raise ValueError(f"{type(norm).__name__} has no 1-D weight to fold scales into")
    _check_width(weight.shape[0], scales, f"{type(norm).__name__} weight")
    bias = getattr(norm, "bias", None)
    saved = [p.clone() for p in (weight, bias) if isinstance(p, torch.Tensor)]
    probe = torch.randn(
        4, weight.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float32
    ).to(device=weight.device, dtype=weight.dtype)
    before = norm(probe).float()
    s = scales.to(weight.device)
    weight.copy_(weight.float() / s)
    if isinstance(bias, torch.Tensor):
        bias.copy_(bias.float() / s)
    after = norm(probe).float() * s
    tolerance = 8 * torch.finfo(weight.dtype).eps * float(before.abs().amax().clamp(min=1e-30))
    if float((after - before).abs().amax()) > tolerance:
        for p, old in zip((weight, bias), saved, strict=False):
            assert isinstance(p, torch.Tensor)
            p.copy_(old)
        raise ValueError(
            f"{type(norm).__name__}'s output does not scale with its weight; scales cannot be "
            "folded into it"
        )


def _check_width(width: int, scales: torch.Tensor, what: str) -> None:
    if scales.shape != (width,):
        raise ValueError(f"{tuple(scales.shape)} scales for a {what} of width {width}")
