"""Finite weights whose GGUF block scales overflow fp16 (a weight of 1e6 in Q4_0: 1e6 / 8 >
65504; an importance matrix's huge weights) are refused before anything is written, naming
the file and tensor: the file would hold Inf/NaN scales that ggml restores as Inf/NaN, and
--json would have crashed on the NaN figures after writing it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qtool.formats.imatrix import write_imatrix
from qtool.gguf_types import GGML_TYPES, ValueType
from qtool.io.gguf_layout import GGUFValue
from qtool.io.gguf_write import write_gguf
from qtool.numerics.gguf.tensor import ScaleOverflow, quantize_tensor
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats
from qtool.spec import GGUFSpec
from tests.conftest import Invoke


def _big(value: float) -> torch.Tensor:
    x = torch.linspace(-1, 1, 4 * 256).reshape(4, 256)
    x[1, 3] = value
    return x


@pytest.mark.parametrize(
    "name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
)
def test_a_block_scale_beyond_fp16_is_refused_by_the_kernel(name: str) -> None:
    spec = GGUFSpec(GGML_TYPES[name])
    quantize_tensor(_big(6e4), spec)  # fits every type's fp16 scale
    with pytest.raises(ScaleOverflow, match=f"overflows {name}'s fp16 block scales"):
        quantize_tensor(_big(1e10), spec)


def test_an_importance_matrix_that_overflows_the_scales_is_named() -> None:
    spec = GGUFSpec(GGML_TYPES["Q4_0"])
    x = _big(0.5)
    quantize_tensor(x, spec, quant_weights=torch.ones(256))
    with pytest.raises(ScaleOverflow, match="importance matrix's weights"):
        quantize_tensor(x, spec, quant_weights=torch.full((256,), 3e38))


def _bigw(path: Path, value: float = 1e6) -> None:
    meta = {"general.architecture": GGUFValue(ValueType.STRING, "llama")}
    weight = _big(value).numpy().astype(np.float32)
    write_gguf(path, meta, [("blk.0.attn_q.weight", "F32", (256, 4))], [weight.tobytes()])


@pytest.mark.parametrize(
    "extra", [(), ("--json",), ("--dry-run", "--estimate"), ("--min-sqnr", "10")]
)
def test_a_gguf_whose_scales_overflow_is_refused_before_writing(
    tmp_path: Path, invoke: Invoke, extra: tuple[str, ...]
) -> None:
    src, out = tmp_path / "bigw.gguf", tmp_path / "out.gguf"
    _bigw(src)
    code, stdout, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "Q4_0",
                               "-o", str(out), *extra)  # fmt: skip
    assert code == 1 and stdout == "" and not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bigw.gguf"]  # no temporary left either
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and "internal error" not in err, err
    message = json.loads(lines[0])["error"]["message"] if "--json" in extra else lines[0]
    assert src.name in message and "blk.0.attn_q.weight" in message
    assert "fp16 block scales" in message and "Q8_0" in message


def test_the_error_budget_passes_over_a_type_whose_scales_overflow(
    tmp_path: Path, invoke: Invoke
) -> None:
    """1e8: Q4_K's super-block scale (1e8 / 15 / 63) overflows fp16, Q5_K's fits: the budget
    records Q4_K as reaching nothing and takes Q5_K, instead of an internal error."""
    src, out = tmp_path / "big.gguf", tmp_path / "out.gguf"
    _bigw(src, 1e8)
    code, stdout, err = invoke("quantize", str(src), "--format", "gguf", "--target-sqnr", "20",
                               "-o", str(out), "--json")  # fmt: skip
    assert code == 0, err
    row = json.loads(stdout)["tensors"][0]
    assert row["out_dtype"] == "Q5_K"
    assert row["decided_by"]["trials"][0] == {"spec": "Q4_K", "sqnr_db": "-Infinity", "bytes": 576}


def test_an_importance_matrix_that_overflows_the_scales_is_refused_naming_it(
    tmp_path: Path, invoke: Invoke
) -> None:
    """Weights of 3e38 (finite, valid as an imatrix) overflow ggml's weighted Q4_0 scale
    search; ggml does not rescale them, so the run refuses naming the imatrix file."""
    src, q = tmp_path / "m.gguf", "blk.0.attn_q.weight"
    _bigw(src, 0.5)
    stats = MatrixStats(np.full((1, 256), 3e38, np.float32), np.array([1], np.int64))
    imatrix = tmp_path / "huge.imatrix.gguf"
    write_imatrix(imatrix, ImportanceMatrix({q: stats}, 1, 1, ("c.txt",)))
    out = tmp_path / "out.gguf"
    code, stdout, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "Q4_0",
                               "--imatrix", str(imatrix), "-o", str(out))  # fmt: skip
    assert code == 1 and stdout == "" and err.count("\n") == 1, err
    assert f"tensor {q!r}" in err and "importance matrix huge.imatrix.gguf's weights" in err
    assert not out.exists()


@pytest.mark.parametrize("name", ["Q4_0", "Q2_K", "Q3_K", "Q4_K", "Q6_K"])
def test_the_reported_block_scale_is_the_blocks_d(name: str) -> None:
    """The table's scale range reads each block's fp16 d where ggml's layout has it (Q2_K's
    and Q3_K's is after their packed scales): doubling the values doubles it."""
    spec = GGUFSpec(GGML_TYPES[name])
    x = torch.linspace(-1, 1, 4 * 256).reshape(4, 256) ** 3
    one = quantize_tensor(x, spec, with_errors=False).scale
    two = quantize_tensor(2 * x, spec, with_errors=False).scale
    assert bool((one != 0).all()) and torch.allclose(two, 2 * one, rtol=1e-2)
