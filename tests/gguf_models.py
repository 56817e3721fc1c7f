"""Tiny llama-architecture models for the GGUF tests, made offline: a Hugging Face directory
(random weights, transformers' LlamaForCausalLM) and the float GGUF convert_hf_to_gguf.py would
make of it, written with gguf-py's GGUFWriter: llama.cpp's names (gguf.TensorNameMap), q/k rows
permuted for rotary (LlamaModel.permute), the hyperparameters and a small byte-level BPE
tokenizer (tokens, types and merges) that transformers' GGUF loader turns into a tokenizer.
Rows are 256 long, so every K-type applies without fallback."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

HIDDEN, FF, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
SPECIALS = ["<s>", "</s>"]


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (byte-level BPE's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[str]]:
    """(tokens, merges): the specials, the byte alphabet and a few merged pairs."""
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n"]
    merged = ["".join(m.split(" ")) for m in merges]
    return [*SPECIALS, *_bytes_to_unicode(), *merged], merges


def make_hf_llama(directory: Path, *, tied: bool = False, seed: int = 0) -> Path:
    """A random tiny LlamaForCausalLM saved as safetensors with its config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, _ = vocabulary()
    config = LlamaConfig(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=FF,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1 so that a swapped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return directory


def permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    shape = w.shape
    return w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def write_float_gguf(hf_dir: Path, out: Path, dtype: str = "F32", name: str = "tiny llama") -> Path:
    """The float GGUF of `hf_dir` as convert_hf_to_gguf.py writes one (2-D weights in `dtype`,
    1-D tensors in F32)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    tokens, merges = vocabulary()
    w = gguf.GGUFWriter(out, "llama")
    w.add_name(name)
    w.add_block_count(LAYERS)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(len(tokens))
    w.add_file_type({"F32": 0, "F16": 1, "BF16": 32}[dtype])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))  # CONTROL, then NORMAL
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    tmap = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, LAYERS)
    for hf_name, t in load_file(hf_dir / "model.safetensors").items():
        gguf_name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        if hf_name.endswith("q_proj.weight"):
            t = permute(t, HEADS, HEADS)
        if hf_name.endswith("k_proj.weight"):
            t = permute(t, HEADS, KV_HEADS)
        bf16 = dtype == "BF16" and t.ndim > 1
        raw = gguf.GGMLQuantizationType.BF16 if bf16 else None
        w.add_tensor(gguf_name, _as(t, dtype if t.ndim > 1 else "F32"), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _as(t: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "F32":
        return t.to(torch.float32).numpy()
    if dtype == "F16":
        return t.to(torch.float16).numpy()
    return t.to(torch.bfloat16).view(torch.int16).numpy()  # BF16 as raw 16-bit words
