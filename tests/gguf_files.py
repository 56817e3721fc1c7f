"""Small GGUF files for the CLI tests, written with gguf-py's GGUFWriter: `odd_gguf` holds one
tensor of each case llama-quantize treats apart (rows of 96 that are not whole K-blocks, rows of
100 that are not whole blocks of any type, a 1-D norm, an expert gate), beside two ordinary
weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np

ODD = {  # name -> torch shape (rows are the last dimension)
    "token_embd.weight": (64, 256),
    "blk.0.attn_q.weight": (64, 96),
    "blk.0.ffn_down.weight": (64, 100),
    "blk.0.attn_norm.weight": (96,),
    "blk.0.ffn_gate_inp.weight": (4, 96),
    "blk.0.ffn_up.weight": (128, 256),
}


def odd_gguf(path: Path, *, seed: int = 0, nan_in: str | None = None) -> Path:
    """A float32 llama-architecture GGUF of the ODD tensors (random; `nan_in` gets a NaN)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("odd")
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_file_type(0)
    for name, shape in ODD.items():
        x = rng.standard_normal(shape).astype(np.float32) * 0.05
        if name.endswith("norm.weight"):
            x += 1
        if name == nan_in:
            x.reshape(-1)[7] = np.nan
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
