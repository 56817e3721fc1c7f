"""Measured sensitivity, the numbers (no I/O): the linear model of a quantized model's loss.

    predicted KL = sum over Linears L of alpha_L * r_L

r_L is the relative output error of Linear L under a candidate, from the importance matrix alone
(h_j = in_sum2_j / counts, the mean of x_j^2 over the calibration tokens), with no forward pass:
numerics.allocate.relative_error, the one definition the allocator and this module share,

    r_L = sum_ij (approx - weight)_ij^2 h_j / sum_ij weight_ij^2 h_j

alpha_L is measured once per Linear: the mean per-token KL(float || model with only L perturbed by
a known error) divided by that error's r_L. KL is second order in a small output error, so it is
proportional to r (a squared error): the model holds while the error stays small enough for the
second-order term to dominate, which the reference error (round to nearest at 4 bits, the middle
of every format's ladder) is chosen to be.
"""

from __future__ import annotations

import math

import torch

REFERENCE_BITS = 4
REFERENCE_GROUP = 32
REFERENCE = f"rtn int{REFERENCE_BITS} g{REFERENCE_GROUP} symmetric absmax"
"""The known perturbation: each group of 32 inputs of a row rounded to the nearest of 15 levels,
-7..7 times max|w| / 7 (the symmetric absmax int4 grid; not ggml's Q4_0, whose scale is the
signed max / -8 and uses 16 levels); its error is what alpha is measured with. alpha is KL per
unit r, so any such reference serves; this one is what the stored files were measured with."""


def reference_error(weight: torch.Tensor) -> torch.Tensor:
    """The reference perturbation of `weight` [N, K]: its round-to-nearest error (approx -
    weight) on the REFERENCE grid; a last group shorter than 32 is its own group."""
    w = weight.detach().double()
    n, k = w.shape
    pad = -k % REFERENCE_GROUP
    groups = torch.nn.functional.pad(w, (0, pad)).reshape(n, -1, REFERENCE_GROUP)
    top = (1 << (REFERENCE_BITS - 1)) - 1
    scale = groups.abs().amax(dim=-1, keepdim=True) / top
    safe = torch.where(scale > 0, scale, 1.0)
    codes = torch.clamp(torch.round(groups / safe), -top - 1, top)
    approx = (codes * scale).reshape(n, -1)[:, :k]
    return (approx - w).to(weight.dtype)


def alpha(kl: float, r: float) -> float:
    """KL per unit r; 0.0 when the perturbation reached nothing (r == 0, or inf: a zero weight
    or no input, where no candidate's error can matter either)."""
    return kl / r if 0.0 < r < math.inf else 0.0


def joint_fit(s1: float, j1: float, s2: float, j2: float) -> tuple[float, float] | None:
    """(gain, saturation) of joint KL = gain S / (1 + saturation S) through two points
    (S = sum alpha r, J = the joint KL measured there): 1/J is linear in 1/S. gain takes the
    sum to the level of the joint measurement's windows; saturation is how much less than
    additive the KL of many perturbed tensors grows (0: additive). None when the points fit
    no such curve of positive gain (J not growing with S: equal KLs, or less KL at the larger
    error, which measurement noise on near-zero KLs can give) or the result is not finite."""
    if not all(0.0 < v < math.inf for v in (s1, j1, s2, j2)) or s1 == s2:
        return None
    slope = (1 / j2 - 1 / j1) / (1 / s2 - 1 / s1)
    if not (slope > 0.0 and math.isfinite(slope)):
        return None
    gain, saturation = 1 / slope, (1 / j1 - slope / s1) / slope
    return (gain, saturation) if math.isfinite(gain) and math.isfinite(saturation) else None


def joint_kl(total: float, gain: float, saturation: float) -> float:
    """The predicted joint KL of a plan whose sum alpha r is `total` (inf past the model's
    pole, where 1 + saturation total <= 0)."""
    den = 1 + saturation * total
    return gain * total / den if den > 0 else math.inf


def sum_within(target: float, gain: float, saturation: float) -> float:
    """The largest sum alpha r whose joint_kl stays within `target` (inf: any)."""
    den = gain - saturation * target
    return target / den if den > 0 else math.inf


def predicted_kl(alphas: dict[str, float], errors: dict[str, float]) -> float:
    """sum_L alpha_L r_L over the Linears of `errors` (KeyError for one without an alpha)."""
    return sum(alphas[name] * r for name, r in sorted(errors.items()))


MAX_SOLVES = 4
"""--target-kl: solves (each followed by a measurement of its plan) before a run that still
measures over its target gives up."""


def tightened(target: float, bound: float, predicted: float, measured: float) -> float:
    """The predicted-KL bound of the next solve of a KL target after a plan within `bound`,
    predicted `predicted`, measured `measured` > target: the predicted KL at which the measured
    one is the target if measured / predicted holds, target x predicted / measured, taken from
    min(bound, predicted), so that every next plan is predicted strictly lower than the last."""
    if not (measured > target > 0.0):
        raise ValueError(f"no bound to tighten: measured {measured} within target {target}")
    return min(bound, predicted) * target / measured
