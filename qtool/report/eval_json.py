"""The `qtool eval --json` document (no rich here; schema in docs/json.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qtool.calibration import texts_json
from qtool.eval_results import (
    CausalFigures,
    EncoderFigures,
    EvalBounds,
    EvalSummary,
    EvalViolation,
    FloatPass,
    LayerRow,
)
from qtool.report.json import SCHEMA_VERSION, json_number


@dataclass(frozen=True)
class FloatSide:
    """The logits file FLOAT's side was read from (`read`: no float pass ran, the KL comes from
    its 16-bit codes) or written to."""

    path: Path
    read: bool

    def as_dict(self) -> dict[str, Any]:
        return {"file": str(self.path), "use": "read" if self.read else "written"}


def eval_json(
    summary: EvalSummary,
    layers: list[LayerRow] | None,
    bounds: EvalBounds,
    violations: list[EvalViolation],
    side: FloatSide | None = None,
) -> dict[str, Any]:
    """The figures of both models on the same tokens; `layers` as the table shows them."""
    return {
        "schema_version": SCHEMA_VERSION,
        "ok": True,
        "command": "eval",
        "inputs": list(summary.inputs),
        "loaded_as": summary.loaded_as,
        "architecture": summary.architecture,
        "kind": summary.kind,
        "text": {
            "source": summary.text.source,
            "chars": summary.text.chars,
            "sha256": summary.text.sha256,
        },
        "tokenizer": summary.tokenizer,
        "tokens": summary.tokens,
        "ctx": summary.ctx,
        "windows": summary.windows,
        "dtype": summary.dtype,
        "device": summary.device,
        "changed_tensors": summary.changed,
        "parameter_tensors": summary.parameters,
        "causal": _causal(summary.causal),
        "encoder": _encoder(summary.encoder),
        "layers": None if layers is None else [_layer(r) for r in layers],
        "seconds": {
            "load": json_number(summary.load_seconds),
            "eval": json_number(summary.eval_seconds),
        },
        "tokens_per_second": json_number(summary.tokens_per_second),
        "notes": list(summary.notes),
        "in_sample": texts_json(summary.in_sample),
        "logits": None if side is None else side.as_dict(),
        "gate": _gate(bounds, violations),
    }


def _causal(c: CausalFigures | None) -> dict[str, Any] | None:
    if c is None:
        return None
    return {
        "perplexity_float": json_number(c.ppl_float),
        "perplexity_quant": json_number(c.ppl_quant),
        "perplexity_ratio": json_number(c.ppl_ratio),
        "kl": {
            "mean": json_number(c.kl.mean),
            "median": json_number(c.kl.median),
            "p90": json_number(c.kl.p90),
            "p99": json_number(c.kl.p99),
            "p999": json_number(c.kl.p999),
            "max": json_number(c.kl.max),
        },
        "ln_ppl_ratio": {"mean": json_number(c.ln_ratio), "se": json_number(c.ln_ratio_se)},
        "mean_dp": json_number(c.dp_mean),
        "top1_agreement": json_number(c.top1),
        "top1_agreeing": c.agree,
        "positions_scored": c.predicted,
    }


def many_json(
    results: list[tuple[EvalSummary, list[EvalViolation]]],
    bounds: EvalBounds,
    side: FloatSide | None,
    measured: FloatPass | None = None,
) -> dict[str, Any]:
    """Several QUANTs against one float pass: `candidates` holds each one's eval document (as
    one QUANT's, without its own schema_version, ok and command), in the order given; `float`:
    FLOAT's side as measured (or read), None when not given."""
    docs = []
    for summary, violations in results:
        doc = eval_json(summary, None, bounds, violations)
        shared = ("schema_version", "ok", "command", "logits")
        docs.append({k: v for k, v in doc.items() if k not in shared})
    return {
        "schema_version": SCHEMA_VERSION,
        "ok": True,
        "command": "eval",
        "candidates": docs,
        "saved_logits": None if side is None or side.read else str(side.path),
        "logits": None if side is None else side.as_dict(),
        "float": None if measured is None else _float(measured),
        "gate": None if not bounds.active else {
            "passed": not any(v for _, v in results),
            "failed": [s.inputs[1] for s, v in results if v],
        },
    }  # fmt: skip


def _float(m: FloatPass) -> dict[str, Any]:
    return {
        "input": m.float_dir,
        "text": {"source": m.text.source, "chars": m.text.chars, "sha256": m.text.sha256},
        "tokens": m.tokens,
        "ctx": m.ctx,
        "windows": m.windows,
        "positions_scored": m.positions,
        "dtype": m.dtype,
        "device": m.device,
        "perplexity_float": json_number(m.ppl_float),
        "seconds": json_number(m.seconds),
    }


def _encoder(e: EncoderFigures | None) -> dict[str, Any] | None:
    if e is None:
        return None
    return {
        "sentences": e.sentences,
        "cosine_mean": json_number(e.cosine_mean),
        "cosine_min": json_number(e.cosine_min),
        "hidden_rel_error": json_number(e.hidden_rel_error),
    }


def _layer(r: LayerRow) -> dict[str, Any]:
    return {
        "name": r.name,
        "shape": list(r.shape),
        "weight_sqnr_db": json_number(r.weight_sqnr_db),
        "output_sqnr_db": json_number(r.output_sqnr_db),
        "tokens": r.tokens,
    }


def _gate(bounds: EvalBounds, violations: list[EvalViolation]) -> dict[str, Any] | None:
    if not bounds.active:
        return None
    return {
        "passed": not violations,
        "bounds": bounds.as_dict(),
        "violations": [
            {
                "bound": v.bound,
                "value": None if v.value is None else json_number(v.value),
                "limit": v.limit,
                "detail": v.detail,
            }
            for v in violations
        ],
    }
