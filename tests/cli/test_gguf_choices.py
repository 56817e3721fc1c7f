"""Every message that refuses a GGUF --dtype lists all that --format gguf takes: the block types
and llama.cpp's mixes (Q4_K_M ...), which --dtype accepts too."""

from __future__ import annotations

import pytest

from qtool.codecs.gguf import GGUF_MIXES, GGUF_QUANTIZE_TYPES, gguf_quantize_spec, gguf_spec
from tests.conftest import Invoke

_ALL = (*GGUF_QUANTIZE_TYPES, *GGUF_MIXES)


@pytest.mark.parametrize("dtype", ["F16", "Q4_X", "IQ2_XXS"])
def test_a_refused_dtype_lists_the_types_and_the_mixes(invoke: Invoke, dtype: str) -> None:
    code, out, err = invoke("quantize", "x.safetensors", "--format", "gguf", "--dtype", dtype)
    assert code == 2 and out == ""
    assert all(name in err for name in _ALL), err


@pytest.mark.parametrize("read", [gguf_spec, gguf_quantize_spec])
def test_the_codecs_refusals_list_the_mixes_too(read: object) -> None:
    with pytest.raises(ValueError) as err:
        read("Q9_Z")  # type: ignore[operator]
    assert all(name in str(err.value) for name in _ALL)
