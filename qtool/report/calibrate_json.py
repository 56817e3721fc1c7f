"""The `qtool calibrate --json` documents (no rich here; schema in docs/json.md)."""

from __future__ import annotations

from typing import Any

from qtool.calibrate_results import (
    CalibrateSummary,
    DatasetInfo,
    JointSummary,
    MergeSummary,
    SensitivitySummary,
)
from qtool.report.json import SCHEMA_VERSION, json_number


def _datasets(datasets: tuple[DatasetInfo, ...]) -> list[dict[str, Any]]:
    return [{"name": d.name, "sha256": d.sha256, "tokens": d.tokens} for d in datasets]


def calibrate_json(s: CalibrateSummary) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "ok": True,
        "command": "calibrate",
        "model": s.model,
        "output": s.output,
        "architecture": s.architecture,
        "datasets": _datasets(s.datasets),
        "ctx": s.ctx,
        "windows": s.windows,
        "tokens": s.tokens,
        "entries": s.entries,
        "blocks": s.blocks,
        "device": s.device,
        "load_seconds": json_number(s.load_seconds),
        "run_seconds": json_number(s.run_seconds),
        "tokens_per_second": json_number(s.tokens_per_second),
        "peak_block_bytes": s.peak_block_bytes,
        "activation_bytes": s.activation_bytes,
        "sensitivity": _sensitivity(s.sensitivity),
    }


def _sensitivity(s: SensitivitySummary | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {
        "reference": s.reference, "tokens": s.tokens, "windows": s.windows,
        "passes": s.passes, "block_loads": s.block_loads, "seconds": json_number(s.seconds),
        "linears": [
            {"name": x.name, "r": json_number(x.r), "kl": json_number(x.kl),
             "alpha": json_number(x.alpha)}
            for x in s.linears
        ],
        "joint": _joint(s.joint),
    }  # fmt: skip


def _joint(j: JointSummary | None) -> dict[str, Any] | None:
    if j is None:
        return None
    gain, saturation, additivity = j.fit if j.fit is not None else (None, None, None)
    return {
        "kl": json_number(j.kl), "kl_half": json_number(j.kl_half), "tokens": j.tokens,
        "kl_sensitivity_windows": json_number(j.kl_few), "fitted": j.fit is not None,
        "gain": None if gain is None else json_number(gain),
        "saturation": None if saturation is None else json_number(saturation),
        "additivity": None if additivity is None else json_number(additivity),
    }  # fmt: skip


def merge_json(s: MergeSummary) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "ok": True,
        "command": "calibrate",
        "merged": list(s.inputs),
        "output": s.output,
        "datasets": _datasets(s.datasets),
        "entries": s.entries,
        "chunk_size": s.chunk_size,
        "chunk_count": s.chunk_count,
    }
