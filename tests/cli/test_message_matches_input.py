"""A message names what qtool found, never another kind of input (issue 33 polish):
`dequantize DIR --qparams X` said "a compressed-tensors model keeps its scales inside" for every
directory, a plain float model directory and a float sharded set included."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Invoke


@pytest.mark.parametrize("directory", ["tiny-llama", "sharded-mlp"])
def test_dequantize_of_a_float_directory_with_qparams_says_it_is_float(
    invoke: Invoke, samples: Path, directory: str
) -> None:
    sidecar = samples / "side.qparams.safetensors"
    sidecar.write_bytes((samples / "mlp.safetensors").read_bytes())
    out = samples / "r.safetensors"
    code, stdout, err = invoke("dequantize", str(samples / directory), "--qparams",
                               str(sidecar), "-o", str(out))  # fmt: skip
    assert code == 1 and stdout == "" and err.count("\n") == 1, err
    assert "nothing to dequantize" in err and "compressed-tensors model keeps" not in err
    assert not out.exists()
