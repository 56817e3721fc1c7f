"""Regenerate sample_weights/ byte for byte (seeded): small, real-looking checkpoints.

    python scripts/make_sample_weights.py [OUTDIR]

mlp:      embedding, two Linear layers with biases, a LayerNorm, a head with one outlier
          channel (so per-tensor vs per-channel shows), an int64 buffer and a 0-d counter.
convnet:  two Conv2d layers with BatchNorm (running stats, int64 num_batches_tracked), a Linear.
mlp-bf16: the mlp in bfloat16, as most LLM checkpoints ship.
sharded-mlp/: the bf16 mlp split in two shards with an HF-style index and a config.json.
tiny-llama/: a Hugging Face model directory (config.json, generation_config.json, bf16
          model.safetensors) of a 2-layer Llama that transformers loads: the
          compressed-tensors export example. Random weights, so its outputs mean nothing.
tiny-llama.gguf: the same Llama as llama.cpp's convert_hf_to_gguf.py writes it (BF16 weights,
          F32 norms, llama.cpp's names, q/k rows permuted for rotary; no tokenizer): the GGUF
          examples of docs/gguf.md.
tiny-lm/: a 2-layer Llama with tied embeddings and a character-level tokenizer (tokenizer.json
          written here, no merges: one token per character, a BOS first): the `qtool eval`
          example. Random weights too: its figures show the report, not a language model.
The .pt files are torch.save state dicts; convnet.pt is wrapped as {"state_dict": ..., "epoch": 7}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def _linear(gen: torch.Generator, out_f: int, in_f: int) -> tuple[torch.Tensor, torch.Tensor]:
    bound = in_f**-0.5
    weight = (torch.rand(out_f, in_f, generator=gen) * 2 - 1) * bound
    bias = (torch.rand(out_f, generator=gen) * 2 - 1) * bound
    return weight, bias


def mlp() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    sd: dict[str, torch.Tensor] = {"embed.weight": torch.randn(256, 64, generator=gen) * 0.02}
    sd["layers.0.fc1.weight"], sd["layers.0.fc1.bias"] = _linear(gen, 128, 64)
    sd["layers.0.norm.weight"] = 1.0 + 0.1 * torch.randn(128, generator=gen)
    sd["layers.0.norm.bias"] = 0.01 * torch.randn(128, generator=gen)
    sd["layers.0.fc2.weight"], sd["layers.0.fc2.bias"] = _linear(gen, 64, 128)
    head_w, head_b = _linear(gen, 10, 64)
    head_w[3] *= 40.0  # one outlier channel: per-tensor quantization suffers, per-channel not
    sd["head.weight"], sd["head.bias"] = head_w, head_b
    sd["position_ids"] = torch.arange(16, dtype=torch.int64).unsqueeze(0)
    sd["step"] = torch.tensor(1000, dtype=torch.int64)
    return sd


def convnet() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5678)
    sd: dict[str, torch.Tensor] = {}
    for name, (c_out, c_in) in {"conv1": (16, 3), "conv2": (32, 16)}.items():
        fan_in = c_in * 9
        sd[f"{name}.weight"] = torch.randn(c_out, c_in, 3, 3, generator=gen) * (2 / fan_in) ** 0.5
        sd[f"{name}.bias"] = torch.zeros(c_out)
        bn = name.replace("conv", "bn")
        sd[f"{bn}.weight"] = 1.0 + 0.05 * torch.randn(c_out, generator=gen)
        sd[f"{bn}.bias"] = 0.05 * torch.randn(c_out, generator=gen)
        sd[f"{bn}.running_mean"] = 0.1 * torch.randn(c_out, generator=gen)
        sd[f"{bn}.running_var"] = 1.0 + 0.1 * torch.rand(c_out, generator=gen)
        sd[f"{bn}.num_batches_tracked"] = torch.tensor(500, dtype=torch.int64)
    sd["fc.weight"], sd["fc.bias"] = _linear(gen, 10, 512)
    return sd


def main(outdir: Path) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    models = {"mlp": mlp(), "convnet": convnet()}
    models["mlp-bf16"] = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in models["mlp"].items()
    }
    for name, sd in models.items():
        save_file(sd, outdir / f"{name}.safetensors", metadata={"format": "pt"})
    torch.save(models["mlp"], outdir / "mlp.pt")
    torch.save({"state_dict": models["convnet"], "epoch": 7}, outdir / "convnet.pt")
    write_sharded(models["mlp-bf16"], outdir / "sharded-mlp")
    write_tiny_llama(outdir / "tiny-llama")
    write_tiny_llama_gguf(outdir / "tiny-llama.gguf")
    write_tiny_lm(outdir / "tiny-lm")


TINY_LLAMA_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "bfloat16",
}


def tiny_llama(
    vocab: int = 128, seed: int = 4242, tied: bool = False, embed_std: float = 0.02
) -> dict[str, torch.Tensor]:
    """The weights of TINY_LLAMA_CONFIG under transformers' names, in bfloat16 (`tied`: no
    lm_head, the embedding serves as the head)."""
    gen = torch.Generator().manual_seed(seed)
    h, i, kv, layers = 64, 128, 2 * 16, 2  # hidden, intermediate, KV heads x head_dim, layers
    sd = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=gen) * embed_std}
    shapes = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    for layer in range(layers):
        p = f"model.layers.{layer}"
        sd[f"{p}.input_layernorm.weight"] = torch.ones(h)
        sd[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
        for name, (n, k) in shapes.items():
            sd[f"{p}.{name}.weight"] = _linear(gen, n, k)[0]
    sd["model.norm.weight"] = torch.ones(h)
    if not tied:
        sd["lm_head.weight"] = torch.randn(vocab, h, generator=gen) * 0.02
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


def write_tiny_llama(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tiny_llama(), directory / "model.safetensors", metadata={"format": "pt"})
    config = json.dumps(TINY_LLAMA_CONFIG, indent=2) + "\n"
    (directory / "config.json").write_text(config)
    generation = {"bos_token_id": 1, "eos_token_id": 2}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


_GGUF_NAMES = {  # transformers' Llama names -> llama.cpp's (gguf-py's TensorNameMap)
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}  # fmt: skip
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute (rows of q/k reordered for rotary)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(path: Path) -> None:
    """tiny_llama() as a float GGUF, written by qtool's own GGUF writer (deterministic)."""
    from qtool.gguf_types import ValueType
    from qtool.io.gguf_layout import GGUFValue
    from qtool.io.gguf_write import write_gguf

    c = TINY_LLAMA_CONFIG
    u32 = {"block_count": c["num_hidden_layers"], "context_length": c["max_position_embeddings"],
           "embedding_length": c["hidden_size"], "feed_forward_length": c["intermediate_size"],
           "attention.head_count": c["num_attention_heads"],
           "attention.head_count_kv": c["num_key_value_heads"],
           "rope.dimension_count": c["head_dim"], "vocab_size": c["vocab_size"]}  # fmt: skip
    meta = {
        "general.architecture": GGUFValue(ValueType.STRING, "llama"),
        "general.name": GGUFValue(ValueType.STRING, "tiny llama"),
        **{f"llama.{k}": GGUFValue(ValueType.UINT32, int(v)) for k, v in u32.items()},  # type: ignore[call-overload]
        "llama.attention.layer_norm_rms_epsilon": GGUFValue(ValueType.FLOAT32, 1e-6),
        "general.file_type": GGUFValue(ValueType.UINT32, 32),  # BF16
    }
    specs, datas = [], []
    for hf, t in tiny_llama().items():
        if hf.endswith("q_proj.weight"):
            t = _permute(t, 4)
        if hf.endswith("k_proj.weight"):
            t = _permute(t, 2)
        if t.ndim == 1:
            t, gtype = t.to(torch.float32), "F32"
        else:
            gtype = "BF16"
        specs.append((_gguf_name(hf), gtype, tuple(reversed(t.shape))))
        datas.append(t.contiguous().view(torch.int16 if gtype == "BF16" else t.dtype).numpy())
    write_gguf(path, meta, specs, datas)


TINY_LM_SPECIALS = ["<unk>", "<s>", "</s>"]
TINY_LM_CHARS = ["\n", " ", *(chr(c) for c in range(33, 127))]  # other characters: <unk>
TINY_LM_VOCAB = len(TINY_LM_SPECIALS) + len(TINY_LM_CHARS)  # 99
TINY_LM_CONFIG = TINY_LLAMA_CONFIG | {
    "vocab_size": TINY_LM_VOCAB,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def tiny_lm_tokenizer() -> dict[str, object]:
    """tokenizer.json of a character-level tokenizer (the `tokenizers` library's format)."""
    special = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, **special, "special": True}
            for i, t in enumerate(TINY_LM_SPECIALS)
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"String": ""},
            "behavior": "Isolated",
            "invert": False,
        },  # fmt: skip
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                bos,
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],  # fmt: skip
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "Fuse"},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(TINY_LM_SPECIALS + TINY_LM_CHARS)},
            "merges": [],
        },  # fmt: skip
    }


def write_tiny_lm(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    weights = tiny_llama(TINY_LM_VOCAB, seed=2424, tied=True, embed_std=0.1)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    files: dict[str, object] = {
        "config.json": TINY_LM_CONFIG,
        "tokenizer.json": tiny_lm_tokenizer(),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "model_max_length": 256,
        },  # fmt: skip
    }
    for name, doc in files.items():
        (directory / name).write_text(json.dumps(doc, indent=2) + "\n")


def write_sharded(sd: dict[str, torch.Tensor], directory: Path) -> None:
    """Two shards: the embedding and head in the first, the layers in the second."""
    directory.mkdir(parents=True, exist_ok=True)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    parts: list[dict[str, torch.Tensor]] = [{}, {}]
    for key, tensor in sd.items():
        parts[1 if key.startswith("layers.") else 0][key] = tensor
    weight_map: dict[str, str] = {}
    for name, part in zip(names, parts, strict=True):
        save_file(part, directory / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (directory / "config.json").write_text('{"model_type": "tiny-mlp", "hidden_size": 64}\n')


if __name__ == "__main__":
    main(
        Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent.parent / "sample_weights"
    )
