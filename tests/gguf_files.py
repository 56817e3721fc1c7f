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


SAMPLE = Path(__file__).parents[1] / "sample_weights" / "tiny-llama.gguf"


def sample_variant(path: Path, **metadata: object) -> Path:
    """sample_weights/tiny-llama.gguf rewritten with its metadata changed: a GGUFValue, or an
    int (written as an INT32, so that it may be negative) per key (dots as '__'); None drops the
    key. Tensors and their bytes are the sample's."""
    from qtool.gguf_types import ValueType
    from qtool.io.gguf_file import GGUFFile
    from qtool.io.gguf_layout import GGUFValue
    from qtool.io.gguf_write import write_gguf

    with GGUFFile(SAMPLE) as f:
        meta = dict(f.header.metadata)
        for key, value in metadata.items():
            key = key.replace("__", ".")
            if value is None:
                meta.pop(key, None)
            elif isinstance(value, GGUFValue):
                meta[key] = value
            else:
                assert isinstance(value, int)
                meta[key] = GGUFValue(ValueType.INT32, value)
        infos = f.header.tensors
        specs = [(t.name, t.type, t.shape) for t in infos]
        write_gguf(path, meta, specs, (f.tensor_bytes(t) for t in infos))
    return path
