"""GGUF's words to the user: every message that refuses a GGUF --dtype lists all that --format
gguf takes (the block types and llama.cpp's mixes, Q4_K_M ..., which --dtype accepts too), and
the plan says why a tensor got another type than its mix's (a fallback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qtool.codecs.gguf import GGUF_MIXES, GGUF_QUANTIZE_TYPES, gguf_quantize_spec, gguf_spec
from tests.conftest import Invoke
from tests.gguf_files import odd_gguf

_ALL = (*GGUF_QUANTIZE_TYPES, *GGUF_MIXES)


@pytest.mark.parametrize("dtype", ["F64", "Q4_X", "IQ2_XXS"])  # F16: a conversion (test_hf_float)
def test_a_refused_dtype_lists_the_types_and_the_mixes(invoke: Invoke, dtype: str) -> None:
    code, out, err = invoke("quantize", "x.safetensors", "--format", "gguf", "--dtype", dtype)
    assert code == 2 and out == ""
    assert all(name in err for name in _ALL), err


@pytest.mark.parametrize("read", [gguf_spec, gguf_quantize_spec])
def test_the_codecs_refusals_list_the_mixes_too(read: object) -> None:
    with pytest.raises(ValueError) as err:
        read("Q9_Z")  # type: ignore[operator]
    assert all(name in str(err.value) for name in _ALL)


def test_the_table_says_why_a_mix_fell_back(invoke: Invoke, tmp_path: Path) -> None:
    """A tensor whose rows are not whole blocks of its mix type names that type and why
    (llama-quantize's fallback), not only the type it got."""
    src = odd_gguf(tmp_path / "odd.gguf")
    code, out, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "Q4_K_M",
                            "--dry-run", "-o", str(tmp_path / "o.gguf"), "--json")  # fmt: skip
    assert code == 0, err
    detail = {t["name"]: t["detail"] for t in json.loads(out)["tensors"]}
    assert detail["blk.0.attn_q.weight"] == (
        "Q5_0 (Q4_K_M: Q4_K; rows of 96 are not whole Q4_K super-blocks (256): Q5_0)"
    )
    assert detail["blk.0.ffn_up.weight"] == "Q4_K (Q4_K_M)"  # no fallback, nothing more said


def test_a_default_dtype_gguf_refuses_is_blamed_on_the_default_not_the_user(
    invoke: Invoke, tmp_path: Path
) -> None:
    """With no --dtype (a recipe typing every tensor or not), the refusal says to give one,
    since the default is not a GGUF type; a --dtype given is named as before."""
    src = odd_gguf(tmp_path / "odd.gguf")
    recipe = tmp_path / "all.toml"
    recipe.write_text('[[rule]]\nmatch = "*"\ndtype = "Q8_0"\n')
    base = ["quantize", str(src), "--format", "gguf", "--dry-run"]
    for extra in ([], ["--recipe", str(recipe)]):
        code, out, err = invoke(*base, *extra)
        assert code == 2 and out == "", extra
        assert "give --dtype (the default, sym int8 axis 0, is not a type" in err, err
    code, _, err = invoke(*base, "--dtype", "int8")
    assert code == 2 and "give --dtype (the default" not in err
    assert "not sym int8 axis 0" in err
