"""The guard: a calibrated result kept for a Linear only where it helps (docs/calibration.md).

The output error of a weight error dW on inputs x is sum over rows of |dW x|^2, which is
n/2 tr(dW H dW^T) with H = (2/n) sum x x^T (numerics/gptq.output_error): so a Hessian per stream
(held-out calibration windows, check text) compares any two candidates on that stream without
running the model again. Only ratios of one stream's errors are used (change())."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qtool.calibration import Guard


def change(candidate: float, baseline: float) -> float:
    """The candidate's error relative to the baseline's, minus 1 (-0.2: 20 % lower); 0 when both
    are 0, +inf when only the baseline is."""
    if baseline == 0.0:
        return 0.0 if candidate == 0.0 else math.inf
    return candidate / baseline - 1.0


@dataclass(frozen=True)
class Verdict:
    """The guard's answer for one Linear: keep the method's result or not, and why."""

    keep: bool
    in_domain: float  # change of the output error on the held-out windows
    check: float  # change of the output error on the check text


def judge(in_domain: float, check: float, policy: Guard, tolerance: float) -> Verdict:
    """Keep where the policy says the method helped (options.Guard)."""
    if policy is Guard.NONE:
        keep = True
    elif policy is Guard.DOMAIN:
        keep = in_domain < 0.0
    else:
        keep = in_domain < 0.0 and check <= tolerance
    return Verdict(keep, in_domain, check)


def percent(value: float) -> str:
    return "+inf %" if math.isinf(value) else f"{value * 100:+.0f} %"


def describe(method: str, verdict: Verdict) -> str:
    """The table's note: 'gptq (-20 % in domain, +3 % on check text)' or 'rtn (gptq: -20 % in
    domain, +35 % on check text)'."""
    figures = f"{percent(verdict.in_domain)} in domain, {percent(verdict.check)} on check text"
    return f"{method} ({figures})" if verdict.keep else f"rtn ({method}: {figures})"
