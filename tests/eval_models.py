"""Tiny models for the `qtool eval` tests, built offline from configs with a fixed seed: a
causal Llama with tied embeddings, one without, and a BERT encoder, each saved with a
byte-level tokenizer (no merges: one token per byte; a BOS for the Llamas, [CLS] ... [SEP] for
BERT). Needs transformers (the interop extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SPECIALS = ["<unk>", "<s>", "</s>", "[CLS]", "[SEP]", "[PAD]"]
VOCAB = 256 + len(SPECIALS)


def save_tokenizer(directory: Path, encoder: bool, extra_bos: str | None = None) -> None:
    """A byte-level tokenizer: every byte is one token, ids after the special tokens."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab |= {ch: len(SPECIALS) + i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    first = extra_bos or ("[CLS]" if encoder else "<s>")
    template = f"{first} $A [SEP]" if encoder else f"{first} $A"
    specials = [(t, vocab[t]) for t in SPECIALS if t in template]
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=specials)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="[PAD]",
    )  # fmt: skip
    fast.save_pretrained(directory)


def build(directory: Path, name: str, shard_bytes: int | None = None) -> Path:
    """Save the tiny model `name` (llama-tied, llama, bert) with its tokenizer into `directory`
    (sharded when `shard_bytes` is given)."""
    import transformers

    model: Any
    torch.manual_seed(0)
    if name == "bert":
        cfg: Any = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=128, initializer_range=0.2,
        )  # fmt: skip
        model = transformers.BertModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            tie_word_embeddings=name == "llama-tied", initializer_range=0.2, bos_token_id=1,
            eos_token_id=2,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.to(torch.bfloat16).eval().save_pretrained(directory, **kwargs)
    save_tokenizer(directory, encoder=name == "bert")
    return directory
