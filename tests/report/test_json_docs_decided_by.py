"""Docs drift: docs/json.md's `decided_by` paragraph names every origin the planner's passes
record (engine/decision.py) and every key report/json.py writes for one; decisions.md's
"The plan" names every kind of origin. `calibrated` and its `method` were missing from both."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from qtool.engine import decision
from qtool.report.json import decided_json
from qtool.results import DecidedBy, RuleRef, Trial
from qtool.spec import QSpec

DOCS = Path(__file__).parents[2] / "docs"


def _decided_by_paragraph() -> str:
    text = (DOCS / "json.md").read_text(encoding="utf-8")
    start = text.index("- `decided_by`")
    return text[start : text.index("\n- `", start + 1)]


def _origins() -> set[str]:
    found = set(re.findall(r'head\(\s*"([a-z-]+)"', inspect.getsource(decision)))
    assert {"budget", "calibrated"} <= found  # the pattern still finds the passes' origins
    return found | {"default", "not-included"}


def test_json_md_names_every_origin_and_key() -> None:
    para = _decided_by_paragraph()
    assert not [o for o in _origins() if f"`{o}`" not in para]
    spec = QSpec()
    every = DecidedBy(
        "quantize", "calibrated", spec, "why", (DecidedBy("keep", "default"),),
        RuleRef("recipe", 1, "*", "r.toml", 3), 30.0, (Trial(spec, 30.0, 8),),
        "fused", "qtool", 1, "gptq",
    )  # fmt: skip
    out = decided_json(every)
    keys = set(out) | set(out["rule"]) | set(out["trials"][0])
    assert not [k for k in sorted(keys) if f"`{k}`" not in para]


def test_decisions_md_names_the_calibrated_origin() -> None:
    text = (DOCS / "decisions.md").read_text(encoding="utf-8")
    plan = text[text.index("## The plan") : text.index("## The command line")]
    assert "`calibrated`" in plan and "`method`" in plan
