"""The summary says what was written, not what was asked: when tensors fell back to another spec
(a GGUF type a row length does not allow, a group as long as a row, so per channel), the
console's totals line and the JSON's `totals.by_spec` count the tensors of each spec written,
as llama-quantize counts them by type."""

from __future__ import annotations

import json

from tests.conftest import SAMPLES, Invoke


def test_a_gguf_run_whose_tensors_all_fell_back_names_the_type_written(invoke: Invoke) -> None:
    args = ("quantize", str(SAMPLES / "tiny-llama.gguf"), "--format", "gguf", "--dtype", "Q4_K",
            "--dry-run")  # fmt: skip
    code, out, _ = invoke(*args)
    assert code == 0
    assert "16 of 21 tensors quantized (Q5_0), 5 kept" in out and "(Q4_K)" not in out
    code, out, _ = invoke(*args, "--json")
    by_spec = json.loads(out)["totals"]["by_spec"]
    assert [(s["spec"], s["tensors"]) for s in by_spec] == [("Q5_0", 16)]


def test_a_run_with_several_specs_counts_each(invoke: Invoke) -> None:
    args = ("quantize", str(SAMPLES / "tiny-llama"), "--dtype", "int4", "--group-size", "64",
            "--dry-run")  # fmt: skip
    code, out, _ = invoke(*args)
    assert code == 0
    assert "16 of 21 tensors quantized (14 sym int4 axis 0, 2 sym int4 group 64), 5 kept" in out
    code, out, _ = invoke(*args, "--json")
    by_spec = json.loads(out)["totals"]["by_spec"]
    assert [(s["spec"], s["tensors"]) for s in by_spec] == [
        ("sym int4 axis 0", 14),
        ("sym int4 group 64", 2),
    ]
    doc = json.loads(out)
    kept = sum(r["bytes_out"] for r in doc["tensors"] if not r["quantized"])
    assert sum(s["bytes"] for s in by_spec) + kept == doc["totals"]["bytes_out"]  # with qparams
