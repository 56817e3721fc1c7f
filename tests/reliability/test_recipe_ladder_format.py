"""A recipe's ladder for a budget or an allocation holds only specs the output format stores:
one it cannot store (a GGUF block type for a qtool or compressed-tensors output) is a recipe
error naming the file (exit 2) before any tensor is read; it was an internal TypeError when
the output was written, or a misleading 'no plan fits'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import Invoke

TINY = Path(__file__).resolve().parents[2] / "sample_weights" / "tiny-llama"


@pytest.mark.parametrize("fmt", ["qtool", "compressed-tensors"])
@pytest.mark.parametrize("target", [("--target-sqnr", "20"), ("--target-bpw", "5")])
def test_a_ladder_spec_the_format_cannot_store_is_refused_up_front(
    invoke: Invoke, tmp_path: Path, fmt: str, target: tuple[str, str]
) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('ladder = ["int8", "Q4_K"]\n')
    out = tmp_path / "out"
    code, stdout, err = invoke("quantize", str(TINY), "--format", fmt, *target, "--recipe",
                               str(recipe), "-o", str(out), "--threads", "1", "--json")  # fmt: skip
    assert (code, stdout) == (2, ""), err
    error = json.loads(err)["error"]
    assert error["code"] == "recipe"
    assert "Q4_K" in error["message"] and str(recipe) in error["message"]
    assert not out.exists()
