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
    in_domain: float | None  # change of the output error on the held-out windows
    check: float | None  # the same on the check text; None: no rows of that stream


def judge(in_domain: float | None, check: float | None, policy: Guard, tolerance: float) -> Verdict:
    """Keep where the policy says the method helped (options.Guard): no held-out rows (None)
    prove nothing, no check text rows raise nothing there."""
    lower = in_domain is not None and in_domain < 0.0
    if policy is Guard.NONE:
        keep = True
    elif policy is Guard.DOMAIN:
        keep = lower
    else:
        keep = lower and (check is None or check <= tolerance)
    return Verdict(keep, in_domain, check)


def percent(value: float) -> str:
    """-0.2 -> '-20%' (no space: a wrapped table cell keeps the figure whole)."""
    return "+inf%" if math.isinf(value) else f"{value * 100:+.0f}%"


def describe(method: str, verdict: Verdict) -> str:
    """The table's note, one level of words inside the table's parentheses: 'gptq: -20% held
    out, +3% check text' (kept) or 'rtn, gptq: -20% held out, +35% check text' (not); 'no check
    text rows' where none reached the Linear."""
    figures = describe_figures(verdict.in_domain, verdict.check)
    return f"{method}: {figures}" if verdict.keep else rounded(method, figures)


def describe_figures(held: float | None, check: float | None) -> str:
    """'-20% held out, +3% check text' (a stream without rows: 'no held-out rows', 'no check
    text rows')."""
    held_out = "no held-out rows" if held is None else f"{percent(held)} held out"
    on_check = "no check text rows" if check is None else f"{percent(check)} check text"
    return f"{held_out}, {on_check}"


def rounded(method: str, why: str) -> str:
    """The note of a Linear rounded to nearest instead of `method`'s result: 'rtn, gptq: why'."""
    return f"rtn, {method}: {why}"
