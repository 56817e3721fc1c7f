"""An allocation's messages name its real cause: a run whose allocation target kept every
tensor it decided float says the allocation did (it said '0 tensors selected ... check
--include/--exclude/--recipe', which selected them), and a target no plan meets because the
format stores none of the ladder's specs for the decided tensors says so (it said 'aim higher
or give a ladder with smaller specs', which cannot help); a target that decided no tensor is
named as given (it was always --target-sqnr)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import Invoke
from tests.gguf_files import odd_gguf

GGUF = Path(__file__).resolve().parents[2] / "sample_weights" / "tiny-llama.gguf"
DRY = ("--dry-run", "--estimate", "--threads", "1")


@pytest.mark.parametrize("target", [("--target-bpw", "64"), ("--target-size", "10MiB")])
def test_an_allocation_that_keeps_every_tensor_float_says_so(
    invoke: Invoke, target: tuple[str, str]
) -> None:
    code, _, err = invoke("quantize", str(GGUF), "--format", "gguf", *target, *DRY)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "0 of 21 tensors" in line]
    assert len(warnings) == 1, err
    assert f"{target[0]}'s allocation" in warnings[0] and "kept float all 16 tensors" in warnings[0]
    assert "selected" not in warnings[0] and "--include" not in warnings[0]


def test_nothing_selected_still_names_the_selection(invoke: Invoke) -> None:
    code, _, err = invoke("quantize", str(GGUF), "--format", "gguf", "--target-bpw", "64",
                          "--include", "nothing.*", *DRY)  # fmt: skip
    assert code == 0, err
    assert "0 of 21 tensors selected for quantization" in err and "kept float all" not in err
    assert "--target-bpw decided no tensor" in err and "--target-sqnr" not in err


@pytest.mark.parametrize("target", [("--target-bpw", "4"), ("--target-size", "1KiB")])
def test_a_ladder_the_format_stores_for_no_decided_tensor_says_so(
    invoke: Invoke, tmp_path: Path, target: tuple[str, str]
) -> None:
    model = odd_gguf(tmp_path / "odd.gguf")  # blk.0.ffn_down.weight: rows of 100, no block fits
    recipe = tmp_path / "r.toml"
    recipe.write_text('ladder = ["Q8_0"]\n')
    code, out, err = invoke("quantize", str(model), "--format", "gguf", *target, "--recipe",
                            str(recipe), "--include", "blk.0.ffn_down.weight", *DRY,
                            "--json")  # fmt: skip
    assert (code, out) == (2, ""), err
    message = json.loads(err)["error"]["message"]
    assert "stores none of the ladder's specs" in message
    assert "blk.0.ffn_down.weight [64, 100]" in message and "rows of 100" in message
    assert "aim higher" not in message and "smaller specs" not in message


def test_a_ladder_that_fits_but_not_small_enough_says_aim_higher(
    invoke: Invoke, tmp_path: Path
) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('ladder = ["Q8_0"]\n')
    code, _, err = invoke("quantize", str(GGUF), "--format", "gguf", "--target-bpw", "2",
                          "--recipe", str(recipe), *DRY, "--json")  # fmt: skip
    assert code == 2, err
    message = json.loads(err)["error"]["message"]
    assert "aim higher" in message and "stores none" not in message
