"""Quality gates: error bounds a CI pipeline can fail on (torch-free).

Per-tensor bounds (`max_mse`, `min_sqnr`) apply to every tensor that has error figures;
`min_overall_sqnr` applies to the figures of all of them pooled; `max_kl_ratio` (a calibrated
quantize run) to the model's KL against the float model on each stream the run measured, as a
multiple of round to nearest's. For `compare`, a mismatch (a
tensor missing on one side, another shape or dtype kind, NaN/Inf values) fails any gate that is
set. A figure that is NaN, or infinite on the wrong side, never passes: every check is written
as "the figure is within the bound", which NaN never is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from qtool.results import CompareRow, ErrorStats, ModelKL, Row


@dataclass(frozen=True)
class Gate:
    max_mse: float | None = None
    min_sqnr: float | None = None
    min_overall_sqnr: float | None = None
    max_kl_ratio: float | None = None

    def __post_init__(self) -> None:
        for name, bound in self.bounds.items():
            if bound is not None and not math.isfinite(bound):
                raise ValueError(f"{name}: a bound must be a finite number, got {bound}")
        if self.max_mse is not None and self.max_mse < 0:
            raise ValueError(f"max_mse: an MSE bound must be >= 0, got {self.max_mse}")
        if self.max_kl_ratio is not None and self.max_kl_ratio <= 0:
            raise ValueError(f"max_kl_ratio: a ratio bound must be > 0, got {self.max_kl_ratio}")

    @property
    def bounds(self) -> dict[str, float | None]:
        return {
            "max_mse": self.max_mse,
            "min_sqnr": self.min_sqnr,
            "min_overall_sqnr": self.min_overall_sqnr,
            "max_kl_ratio": self.max_kl_ratio,
        }

    @property
    def active(self) -> bool:
        return any(v is not None for v in self.bounds.values())

    @property
    def per_tensor(self) -> bool:
        """A bound each tensor is held to (the others are the model's or the pooled figure's)."""
        return self.max_mse is not None or self.min_sqnr is not None


@dataclass(frozen=True)
class Violation:
    tensor: str | None  # None: the overall figure
    metric: str  # "mse", "sqnr_db", "overall_sqnr_db", "mismatch"
    value: float | None
    bound: float | None
    detail: str = ""


@dataclass(frozen=True)
class GateResult:
    gate: Gate
    violations: list[Violation]

    @property
    def passed(self) -> bool:
        return not self.violations

    def failed_tensors(self) -> set[str]:
        return {v.tensor for v in self.violations if v.tensor is not None}


def evaluate(
    gate: Gate,
    rows: Sequence[Row],
    overall: ErrorStats | None,
    mismatches: Sequence[CompareRow],
    model_kl: Sequence[ModelKL] = (),
) -> GateResult:
    """Every bound each tensor (and the pool, and the model's KL) breaks; nothing when no
    bound is set."""
    if not gate.active:
        return GateResult(gate, [])
    out = [Violation(r.name, "mismatch", None, None, r.detail) for r in mismatches]
    for r in rows:
        if r.errors is not None:
            out += _tensor_violations(gate, r.name, r.errors)
    bound = gate.min_overall_sqnr
    if bound is not None and overall is not None and not _pooled_ok(overall, bound):
        detail = f"pooled SQNR {_db(overall.sqnr_db)} is below {_db(bound)}"
        out.append(Violation(None, "overall_sqnr_db", overall.sqnr_db, bound, detail))
    if gate.max_kl_ratio is not None:
        out += [_kl_violation(k, gate.max_kl_ratio) for k in model_kl
                if not k.ratio <= gate.max_kl_ratio]  # fmt: skip
    return GateResult(gate, out)


def _kl_violation(figure: ModelKL, bound: float) -> Violation:
    """The chosen result's model KL on one stream above `bound` times round to nearest's."""
    where = kl_where(figure.stream)
    detail = (f"model KL on the {where} {figure.chosen:.4g} nats/token is {figure.ratio:.3g}x "
              f"round to nearest's {figure.rounding:.4g}, above {bound:g}x")  # fmt: skip
    return Violation(None, "model_kl_ratio", figure.ratio, bound, detail)


def kl_where(stream: str) -> str:
    """The noun a model-KL stream is measured on ('held-out' -> 'held-out windows')."""
    return "held-out windows" if stream == "held-out" else stream


def _pooled_ok(overall: ErrorStats, bound: float) -> bool:
    return overall.finite and overall.sqnr_db >= bound


def _tensor_violations(gate: Gate, name: str, stats: ErrorStats) -> list[Violation]:
    """The per-tensor bounds this tensor breaks; non-finite figures break every bound set."""
    out = []
    broken = "" if stats.finite else "figures are not finite (NaN/Inf values): "
    mse_ok = stats.finite and stats.mse <= (gate.max_mse or 0.0)
    if gate.max_mse is not None and not mse_ok:
        detail = f"{broken}MSE {stats.mse:.4g} is above {gate.max_mse:.4g}"
        out.append(Violation(name, "mse", stats.mse, gate.max_mse, detail))
    sqnr_ok = stats.finite and stats.sqnr_db >= (gate.min_sqnr or 0.0)
    if gate.min_sqnr is not None and not sqnr_ok:
        detail = f"{broken}SQNR {_db(stats.sqnr_db)} is below {_db(gate.min_sqnr)}"
        out.append(Violation(name, "sqnr_db", stats.sqnr_db, gate.min_sqnr, detail))
    return out


def _db(value: float) -> str:
    if value == -math.inf:
        return "-inf dB (the reference is all zeros and the other side is not)"
    return f"{value:.2f} dB" if math.isfinite(value) else f"{value} dB"
