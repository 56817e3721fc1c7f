"""Quality gates: error bounds a CI pipeline can fail on (torch-free).

Per-tensor bounds (`max_mse`, `min_sqnr`) apply to every tensor that has error figures;
`min_overall_sqnr` applies to the figures of all of them pooled. For `compare`, a tensor missing
on one side or with a different shape also fails any gate that is set.
"""

from __future__ import annotations

from dataclasses import dataclass

from qtool.results import ErrorStats, TensorRow


@dataclass(frozen=True)
class Gate:
    max_mse: float | None = None
    min_sqnr: float | None = None
    min_overall_sqnr: float | None = None

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.max_mse, self.min_sqnr, self.min_overall_sqnr))


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
    gate: Gate, rows: list[TensorRow], overall: ErrorStats | None, mismatches: list[TensorRow]
) -> GateResult:
    """Every bound each tensor (and the pool) breaks; nothing when no bound is set."""
    if not gate.active:
        return GateResult(gate, [])
    out = [Violation(r.name, "mismatch", None, None, r.detail) for r in mismatches]
    for r in rows:
        if r.errors is None:
            continue
        if gate.max_mse is not None and r.errors.mse > gate.max_mse:
            out.append(Violation(r.name, "mse", r.errors.mse, gate.max_mse))
        if gate.min_sqnr is not None and r.errors.sqnr_db < gate.min_sqnr:
            out.append(Violation(r.name, "sqnr_db", r.errors.sqnr_db, gate.min_sqnr))
    bound = gate.min_overall_sqnr
    if bound is not None and overall is not None and overall.sqnr_db < bound:
        out.append(Violation(None, "overall_sqnr_db", overall.sqnr_db, bound))
    return GateResult(gate, out)
