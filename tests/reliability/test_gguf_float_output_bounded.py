"""Issue 28 class 3 for the float GGUF that `dequantize X.gguf -o Y.gguf` writes (issue 33 item
8): a quantized tensor whose float32 values are larger than the memory qtool may use is written
a slab of rows at a time, as the safetensors output is (tests/reliability/test_gguf_streaming.py
has the cap and the sparse files)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from qtool.formats.gguf.reader import GGUFFloatReader
from tests.reliability.test_gguf_streaming import Q4_K, ROW, ROWS, _capped, _sparse

pytest.importorskip("gguf")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and sparse files")
def test_class3_a_quantized_tensor_is_written_to_a_float_gguf_slab_by_slab(
    tmp_path: Path,
) -> None:
    """A Q4_K tensor of 512 MiB of float32 values, under a cap of 384 MiB over the baseline,
    becomes an F32 GGUF tensor of 512 MiB, exit 0, zeros where the zero blocks were."""
    q4 = _sparse(tmp_path / "q4.gguf", Q4_K, ROW * ROWS // 256 * 144)
    out = tmp_path / "f32.gguf"
    done = _capped("dequantize", str(q4), "-o", str(out))
    assert done.returncode == 0, done.stderr
    with GGUFFloatReader(out) as r:
        assert r.stored_dtype("blk.0.ffn_up.weight") == "F32"
        assert r.nbytes("blk.0.ffn_up.weight") == ROW * ROWS * 4
    with out.open("rb") as f:
        f.seek(-(1 << 20), os.SEEK_END)
        assert f.read() == bytes(1 << 20)
