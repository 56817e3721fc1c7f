"""A rule that asks a spec for a tensor compressed-tensors cannot store says why it stays float
(issue 33 polish: examples/bert.toml's int8 rule for word_embeddings silently became "kept:
embedding"): the reason names the format's limit, nn.Linear weights only; a tensor no rule
named keeps its short reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import Invoke
from tests.eval_models import build

pytest.importorskip("transformers")
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "bert.toml"
WHY = "compressed-tensors quantizes nn.Linear weights only"


def _reasons(invoke: Invoke, model: Path, out: Path, *args: str) -> dict[str, str]:
    code, stdout, err = invoke("quantize", str(model), "--format", "compressed-tensors",
                               "--dry-run", "--json", "-o", str(out), *args)  # fmt: skip
    assert code == 0, err
    return {t["name"]: t["detail"] for t in json.loads(stdout)["tensors"]}


def test_a_rule_for_an_embedding_says_the_format_keeps_it_and_why(
    invoke: Invoke, tmp_path: Path
) -> None:
    model = build(tmp_path / "bert", "bert")
    asked = _reasons(invoke, model, tmp_path / "a", "--recipe", str(RECIPE))
    assert WHY in asked["embeddings.word_embeddings.weight"]
    assert "rule 2" in asked["embeddings.word_embeddings.weight"]
    assert WHY not in asked["embeddings.position_embeddings.weight"]  # a keep rule: its words
    plain = _reasons(invoke, model, tmp_path / "b")
    assert plain["embeddings.word_embeddings.weight"] == "kept: embedding"
