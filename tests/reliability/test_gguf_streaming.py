"""Issue 28, class 3 (work and memory bounded by what was asked, never by a number in a file),
the GGUF tensors themselves: a GGUF tensor larger than the memory qtool may use is quantized
(--format gguf) and dequantized a slab of rows at a time, as safetensors inputs are, so peak
memory is a slab plus the output's codes, not the tensor. Memory is bounded by an address-space
cap (RLIMIT_AS) in a subprocess, over the baseline the child measures itself after its imports;
the files are sparse (zeros), so the disk holds only what is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from qtool.formats.gguf import reader as gguf_reader
from qtool.formats.gguf.reader import GGUFFloatReader
from qtool.numerics import gguf as G
from tests.corpus_gguf import STRING, gguf, kv, kv_u32, s, ti

pytest.importorskip("gguf")
ARCH = kv("general.architecture", STRING, s("llama"))
F32, Q4_K = 0, 12
ROW, ROWS = 4096, 32768  # one 512 MiB F32 tensor (128 Mi values)
HEADROOM = 384 << 20  # the cap over the child's own baseline: under the tensor's size

_CAPPED = """
import resource, sys
import torch
from qtool.cli.app import main
vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:"))
cap = vm * 1024 + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
main(sys.argv[2:])
"""


def _sparse(path: Path, gtype: int, nbytes: int) -> Path:
    head = gguf([ARCH, kv_u32("llama.block_count", 1)],
                infos=[ti("blk.0.ffn_up.weight", [ROW, ROWS], gtype)])  # fmt: skip
    with path.open("wb") as f:
        f.write(head)
        f.truncate(len(head) + nbytes)
    assert path.stat().st_blocks * 512 < 1 << 20
    return path


def _capped(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CAPPED, str(HEADROOM), *args],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "QTOOL_KERNEL": "torch"},
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and sparse files")
def test_class3_a_gguf_tensor_larger_than_the_memory_cap_is_streamed(tmp_path: Path) -> None:
    """A 512 MiB F32 tensor (a sparse file) under a cap of 384 MiB over the baseline: quantized
    to Q4_K (72 MiB of codes) and a Q4_K tensor of the same shape dequantized to float16 (256
    MiB written), both exit 0 with the right bytes. Before, both read or built the tensor whole
    and failed ('does not fit in the memory qtool may use')."""
    f32 = _sparse(tmp_path / "f32.gguf", F32, ROW * ROWS * 4)
    done = _capped("quantize", str(f32), "--format", "gguf", "--dtype", "Q4_K",
                   "-o", str(tmp_path / "q.gguf"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    with GGUFFloatReader(tmp_path / "q.gguf") as r:
        assert r.stored_dtype("blk.0.ffn_up.weight") == "Q4_K"
        assert r.nbytes("blk.0.ffn_up.weight") == ROW * ROWS // 256 * 144
    (tmp_path / "q.gguf").unlink()
    q4 = _sparse(tmp_path / "q4.gguf", Q4_K, ROW * ROWS // 256 * 144)
    out = tmp_path / "d.safetensors"
    done = _capped("dequantize", str(q4), "-o", str(out), "--to", "float16")
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size > ROW * ROWS * 2
    with out.open("rb") as f:  # zero blocks dequantize to zeros: spot-check the last rows
        f.seek(-(1 << 20), os.SEEK_END)
        assert f.read() == bytes(1 << 20)


@pytest.mark.parametrize("gtype", ["F32", "F16", "BF16", "Q8_0", "Q4_K", "Q6_K"])
def test_slabs_give_the_values_of_the_whole_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gtype: str
) -> None:
    """Dequantized a slab of rows at a time (a tiny slab: 8 rows of 256), a tensor gives the
    values and the file `values` gives, for a 3-D tensor too; its values checked slab by slab."""
    import gguf as gguf_py

    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 37, 256)) * 0.02).astype(np.float32)
    qtype = gguf_py.GGMLQuantizationType[gtype]
    data = x.astype(np.float16) if gtype == "F16" else x
    w = gguf_py.GGUFWriter(tmp_path / "x.gguf", "llama")
    if gtype in ("F32", "F16"):
        w.add_tensor("t", data)
    else:
        raw = G.quantize(torch.from_numpy(x), gtype).numpy()
        w.add_tensor("t", raw, raw_shape=(3, 37, raw.shape[-1]), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    monkeypatch.setattr(gguf_reader, "SLAB_BYTES", 8 * 256 * 4)
    with GGUFFloatReader(tmp_path / "x.gguf") as r:
        for dtype in (None, torch.float16):
            whole = r.values("t", dtype).reshape(-1)
            parts = [t.clone().reshape(-1) for t in r.slabs("t", dtype)]
            assert len(parts) == -(-3 * 37 // 8)
            assert torch.equal(torch.cat(parts), whole)
    from qtool import api

    api.dequantize(tmp_path / "x.gguf", tmp_path / "o.safetensors")
    with GGUFFloatReader(tmp_path / "x.gguf") as r:
        assert torch.equal(load_file(tmp_path / "o.safetensors")["t"], r.values("t"))


@pytest.mark.parametrize("mode", ["write", "plan", "estimate"])
def test_class3_the_size_model_counts_the_alignment_padding(tmp_path: Path, mode: str) -> None:
    """A GGUF at the largest alignment allowed (64 KiB) with tensors of a few KiB: the report
    and the dry runs count each tensor's padding, so the bytes they report are the bytes of the
    data section written (they said 16.0 KiB -> 4.2 KiB while 64 KiB blocks were written). The
    kept norm fills its 64 KiB: a kept tensor is reported at its own size (see reliability.md)."""
    from qtool import api
    from qtool.engine.plan import QuantizeOptions
    from qtool.gguf_types import ValueType
    from qtool.io.gguf_file import GGUFFile
    from qtool.io.gguf_layout import GGUFValue
    from qtool.io.gguf_write import write_gguf
    from qtool.spec import FormatName, gguf_spec

    meta = {"general.architecture": GGUFValue(ValueType.STRING, "llama"),
            "general.alignment": GGUFValue(ValueType.UINT32, 1 << 16)}  # fmt: skip
    datas = [np.ones((8, 256), np.float32), np.ones(1 << 14, np.float32),
             np.ones((4, 64), np.float32)]  # fmt: skip
    specs = [("blk.0.ffn_up.weight", "F32", [256, 8]), ("blk.0.attn_norm.weight", "F32", [1 << 14]),
             ("blk.0.ffn_down.weight", "F32", [64, 4])]  # fmt: skip
    write_gguf(tmp_path / "a.gguf", meta, specs, datas)
    out = tmp_path / "q.gguf"
    options = QuantizeOptions(gguf_spec("Q8_0"), format=FormatName.GGUF)
    summary = api.quantize(tmp_path / "a.gguf", out, options, mode=mode, device="cpu")
    assert [r.bytes_out for r in summary.rows if r.quantized] == [1 << 16] * 2
    reported = sum(r.bytes_out for r in summary.rows)
    assert reported == 3 << 16
    if mode == "write":
        with GGUFFile(out) as f:
            assert out.stat().st_size - f.header.data_start == reported
