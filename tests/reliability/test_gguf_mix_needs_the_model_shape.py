"""A llama.cpp mix (--dtype Q4_K_M) reads the model's block count and heads from the GGUF's
metadata: a file without them is refused with one line naming it, not a traceback."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qtool.gguf_types import ValueType
from qtool.io.gguf_layout import GGUFValue
from qtool.io.gguf_write import write_gguf
from tests.conftest import Invoke


def test_a_gguf_without_its_block_count_is_refused_for_a_mix(
    tmp_path: Path, invoke: Invoke
) -> None:
    src = tmp_path / "no-blocks.gguf"
    meta = {"general.architecture": GGUFValue(ValueType.STRING, "llama")}
    weight = np.zeros((4, 256), dtype=np.float32)
    write_gguf(src, meta, [("blk.0.attn_q.weight", "F32", (256, 4))], [weight.tobytes()])
    out = tmp_path / "out.gguf"
    code, stdout, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "Q4_K_M",
                               "-o", str(out))  # fmt: skip
    assert code == 1 and stdout == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(src.name) in lines[0] and "llama.block_count" in lines[0]
    assert "Traceback" not in err and not out.exists()
