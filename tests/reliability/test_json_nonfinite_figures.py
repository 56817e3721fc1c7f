"""Every figure of a --json document is a JSON number or one of the strings "NaN", "Infinity",
"-Infinity": a damaged input's NaN/Inf figures (in rows and totals) never crash the printer
after the output was written (Python's json refuses them with allow_nan=False)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from qtool.calibrate_results import CalibrateSummary, DatasetInfo
from qtool.codecs.gguf import GGUFSpec
from qtool.eval_results import (
    CausalFigures,
    Distribution,
    EncoderFigures,
    EvalBounds,
    EvalSummary,
    EvalViolation,
    LayerRow,
    TextInfo,
)
from qtool.gguf_types import GGML_TYPES
from qtool.report.calibrate_json import calibrate_json
from qtool.report.eval_json import eval_json
from qtool.report.json import compare_json, json_text, quantize_json
from qtool.results import (
    CompareRow,
    CompareSummary,
    ErrorStats,
    QuantizeRow,
    QuantizeSummary,
    WeightedError,
)

NAN, INF = math.nan, math.inf
_STRINGS = {"NaN", "Infinity", "-Infinity"}


def _strict(text: str) -> Any:
    def refuse(name: str) -> float:
        raise AssertionError(f"bare {name} in the JSON text")

    return json.loads(text, parse_constant=refuse)


def _bad_errors() -> ErrorStats:
    return ErrorStats(numel=4, sq_error=NAN, sq_signal=INF, max_abs=-INF, sq_error_minmax=NAN)


def _quantize_doc() -> dict[str, Any]:
    spec = GGUFSpec(GGML_TYPES["Q4_0"])
    row = QuantizeRow("w", (4, 32), "F32", "Q4_0", True, "Q4_0", 512, 72, _bad_errors(),
                      scale_range=(NAN, INF), spec=spec,
                      weighted=WeightedError(INF, NAN))  # fmt: skip
    return quantize_json(QuantizeSummary(["in.gguf"], ["out.gguf"], [row, row], spec, "cpu"))


def _compare_doc() -> dict[str, Any]:
    row = CompareRow("w", (4, 32), "F32", "Q4_0", "dequantized vs F32", 512, 72,
                     _bad_errors(), compared=True, restored="Q4_0")  # fmt: skip
    summary = CompareSummary(["a.gguf", "b.gguf"], [row, row])
    return compare_json(summary, summary.rows, None)


def _calibrate_doc() -> dict[str, Any]:
    summary = CalibrateSummary("m", "o.gguf", "llama", (DatasetInfo("t", None, 3),), 8, 1, 3,
                               2, 1, "cpu", NAN, -INF, 0, 0)  # fmt: skip
    return calibrate_json(summary)


def _eval_doc() -> dict[str, Any]:
    kl = Distribution(NAN, INF, -INF, NAN, INF)
    causal = CausalFigures(NAN, INF, kl, 1, 2)
    encoder = EncoderFigures(3, NAN, -INF, INF)
    layer = LayerRow("q", (4, 4), NAN, -INF, 2)
    summary = EvalSummary(("f", "q"), "safetensors", "llama", "causal", TextInfo("t", 3, "0"), "f",
                          3, 8, 1, "float32", "cpu", 1, 2, causal, encoder, (layer,), NAN,
                          0.0)  # fmt: skip
    bounds = EvalBounds(max_kl=1.0)
    violation = EvalViolation("max_kl", NAN, 1.0, "kl")
    return eval_json(summary, [layer, layer], bounds, [violation])


@pytest.mark.parametrize("build", [_quantize_doc, _compare_doc, _calibrate_doc, _eval_doc])
@pytest.mark.parametrize("indent", [None, 2])
def test_nonfinite_figures_print_as_the_contract_strings(build: Any, indent: int | None) -> None:
    doc = _strict(json_text(build(), indent=indent))
    found = set()

    def walk(v: object) -> None:
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, str) and v in _STRINGS:
            found.add(v)

    walk(doc)
    assert found  # the figures are there, spelled as strings
    if "tensors" in doc:
        row, totals = doc["tensors"][0], doc["totals"]
        assert row["mse"] == "NaN" and row["sqnr_db"] == "NaN"
        assert row["max_abs_error"] == "-Infinity"
        assert totals["mse"] == "NaN"
    if doc["command"] == "quantize":
        first = doc["tensors"][0]
        assert (first["scale_min"], first["scale_max"]) == ("NaN", "Infinity")


def test_a_raw_nonfinite_float_anywhere_in_a_document_is_spelled_not_raised() -> None:
    """The printer's net for a builder that forgot json_number: rows and skeleton alike."""
    doc = {"a": INF, "totals": {"x": [NAN, -INF, 1.5]}, "tensors": [{"v": NAN}, {"v": 2.0}]}
    for indent in (None, 2):
        got = _strict(json_text(doc, indent=indent))
        assert got == {"a": "Infinity", "totals": {"x": ["NaN", "-Infinity", 1.5]},
                       "tensors": [{"v": "NaN"}, {"v": 2.0}]}  # fmt: skip
