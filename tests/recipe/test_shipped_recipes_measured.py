"""Every recipe shipped in examples/ shows, beside its rules, what it was measured to give and
against which plain run (issue 33 item 3: examples/llm.toml was bigger and worse than
`--dtype int4 --group-size 64` on the model it was written for, and nothing said so). The
figures themselves come from runs by hand on the real models (too slow for CI); this keeps a
recipe from being shipped, or rewritten, without them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"
RECIPES = sorted(EXAMPLES.glob("*.toml"))


def _header(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return " ".join(lines)


def test_there_are_recipes() -> None:
    assert {p.name for p in RECIPES} >= {"llm.toml", "bert.toml", "mlp.toml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_a_shipped_recipe_shows_its_measurement_beside_a_plain_run(recipe: Path) -> None:
    header = _header(recipe)
    assert "Measured on" in header, f"{recipe.name}: no measurement in its header"
    assert re.search(r"`--dtype [^`]+`", header), f"{recipe.name}: no plain run to compare with"
    assert re.search(r"\d+(\.\d+)? (MiB|KiB)", header), f"{recipe.name}: no size"
