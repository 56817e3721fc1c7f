"""Work is bounded by the input, not by what a file asks for: patterns from recipes and
ignore lists share one time budget per file (many slow patterns, thousands of them, one
nested too deep for the compiler), refused in one line naming the file. Recipe matching:
test_recipe_bounded_work.py; GGUF headers: test_gguf_bounds.py; memory: test_calibrate_memory.py,
test_gguf_streaming.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qtool import patterns
from tests.conftest import SAMPLES
from tests.conftest import run_qtool as invoke
from tests.outputs import CT

SLOW = "(.*)" * 6  # ~0.05 s per match on a module name: under the per-match limit


@pytest.mark.slow
def test_many_slow_ignore_patterns_are_refused_within_a_total_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(patterns, "TOTAL_LIMIT_S", 0.3)
    out = tmp_path / "q"
    assert invoke("quantize", str(SAMPLES / "tiny-llama"), *CT, "-o", str(out))[0] == 0
    doc = json.loads((out / "config.json").read_text())
    doc["quantization_config"]["ignore"] += [f"re:{SLOW}X{i}" for i in range(31)]
    (out / "config.json").write_text(json.dumps(doc))
    code, _, err = invoke("inspect", str(out))
    assert code == 1 and "in total" in err and "config.json" in err, err
    assert SLOW in err and "internal error" not in err


def test_many_slow_recipe_patterns_are_refused_within_a_total_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(patterns, "TOTAL_LIMIT_S", 0.3)
    recipe = tmp_path / "r.toml"
    slow = "(.*)" * 5  # tensor names are longer than module names
    rules = "".join(f'[[rule]]\nmatch = "re:{slow}X{i}"\nkeep = "k"\n' for i in range(31))
    recipe.write_text(rules)
    args = ["quantize", str(SAMPLES / "tiny-llama"), *CT, "--recipe", str(recipe)]
    code, _, err = invoke(*args, "-o", str(tmp_path / "o"), "--dry-run")
    assert code != 0 and "in total" in err and str(recipe) in err and "line " in err, err
    assert "internal error" not in err


def test_the_budget_belongs_to_one_file_not_to_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each bounded block (one file's patterns) starts afresh; results are remembered."""
    monkeypatch.setattr(patterns, "TOTAL_LIMIT_S", 0.2)
    slow = SLOW + "Y"
    for _ in range(3):
        with patterns.bounded():
            assert not patterns.matches(slow, "model.layers.0.mlp.up_proj")
    with patterns.bounded():
        for i in range(50):
            assert patterns.matches(r".*\.mlp\..*", f"model.layers.{i}.mlp.up_proj")


@pytest.mark.parametrize("depth", [5000, 499])  # over the length cap; under it, too deep for re
def test_a_deeply_nested_recipe_pattern_is_a_recipe_error(tmp_path: Path, depth: int) -> None:
    recipe = tmp_path / "r.toml"
    pattern = "(" * depth + ")" * depth
    recipe.write_text(f'# deep\n[[rule]]\nmatch = "re:{pattern}"\nkeep = "k"\n')
    args = ["quantize", str(SAMPLES / "tiny-llama"), *CT, "--recipe", str(recipe)]
    code, _, err = invoke(*args, "-o", str(tmp_path / "o"), "--dry-run")
    assert code == 2 and "internal error" not in err and "RecursionError" not in err, err
    assert str(recipe) in err and "line 3" in err and "match" in err, err


def test_compiling_thousands_of_patterns_counts_against_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More distinct long patterns than the compile cache holds, recompiled for every module:
    compiling is bounded like matching."""
    monkeypatch.setattr(patterns, "TOTAL_LIMIT_S", 0.5)
    out = tmp_path / "q"
    assert invoke("quantize", str(SAMPLES / "tiny-llama"), *CT, "-o", str(out))[0] == 0
    doc = json.loads((out / "config.json").read_text())
    doc["quantization_config"]["ignore"] += [
        "re:" + "(a|b)" * 150 + f"x{i:05d}" for i in range(5000)
    ]
    (out / "config.json").write_text(json.dumps(doc))
    code, _, err = invoke("inspect", str(out))
    assert code == 1 and "in total to compile and match" in err and "config.json" in err, err
