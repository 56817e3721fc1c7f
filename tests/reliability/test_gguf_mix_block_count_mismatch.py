"""A llama.cpp mix's rules count layers against {arch}.block_count: a GGUF whose block count
disagrees with the blocks its tensors name (fewer, more, or 0) is refused with one line naming
the file and both numbers, before anything is written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qtool.gguf_types import ValueType
from qtool.io.gguf_layout import GGUFValue
from qtool.io.gguf_write import write_gguf
from tests.conftest import Invoke


@pytest.mark.parametrize("declared", [0, 1, 3])
def test_a_block_count_other_than_the_tensors_blocks_is_refused_for_a_mix(
    tmp_path: Path, invoke: Invoke, declared: int
) -> None:
    src = tmp_path / f"bc{declared}.gguf"
    meta = {
        "general.architecture": GGUFValue(ValueType.STRING, "llama"),
        "llama.block_count": GGUFValue(ValueType.UINT32, declared),
        "llama.attention.head_count": GGUFValue(ValueType.UINT32, 2),
    }
    weight = np.zeros((4, 256), dtype=np.float32).tobytes()
    names = [f"blk.{i}.{n}.weight" for i in (0, 1) for n in ("attn_q", "attn_v")]
    write_gguf(src, meta, [(n, "F32", (256, 4)) for n in names], [weight] * len(names))
    out = tmp_path / "out.gguf"
    code, stdout, err = invoke("quantize", str(src), "--format", "gguf", "--dtype", "Q4_K_M",
                               "-o", str(out))  # fmt: skip
    assert code == 1 and stdout == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and src.name in lines[0], err
    assert f"llama.block_count is {declared}" in lines[0] and "missing" not in lines[0]
    if declared:
        assert "blocks 0 to 1 (2)" in lines[0]
    assert "Traceback" not in err and not out.exists()
