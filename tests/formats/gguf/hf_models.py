"""Tiny Hugging Face model directories of the Llama family, built offline for the HF -> GGUF
export's tests: a byte-level BPE tokenizer trained on a few sentences (tokenizers), the model
from a config with random weights (transformers, seeded), saved as safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TEXT = (
    "The quick brown fox jumps over the lazy dog. Quantized models run on small machines.\n"
    "llama.cpp loads GGUF files; transformers loads safetensors. 3.14 and 42 are numbers!\n"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
TOKENIZER_SIZE = 300  # 256 bytes, 3 special tokens, the rest merges
VOCAB_SIZE = 320  # above the tokenizer's: ids 300..319 are [PADn] in the GGUF


def write_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer.json and tokenizer_config.json (bos/eos/pad, chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT] * 4, trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def write_model(directory: Path, arch: str, *, tied: bool = False, **extra: Any) -> Path:
    """A tiny model of `arch` ("llama", "mistral" or "qwen2") saved in `directory` with the
    tokenizer; q/k/v biases for qwen2 (as Qwen2 has them)."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=0,
        rope_theta=10000.0, **extra,
    )  # fmt: skip
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    config_class, model_class = classes[arch]
    torch.manual_seed(0)
    model = model_class(config_class(**common))
    with torch.no_grad():  # biases are zero at init: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return directory
