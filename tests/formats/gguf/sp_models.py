"""Tiny SentencePiece model directories of the Llama family, built offline: a tokenizer.model
trained by sentencepiece on a few KB of text with Llama 2's trainer options, a config shrunk
from the real model's (Llama-2-7b-chat-hf, Mistral-7B-Instruct-v0.1, TinyLlama-1.1B-Chat-v1.0),
their tokenizer_config.json with the real chat templates, random weights (transformers,
seeded) as safetensors."""

from __future__ import annotations

import io
import json
from hashlib import sha256
from pathlib import Path
from typing import Any

import torch

TEXT = (
    "The quick brown fox jumps over the lazy dog. Quantized models run on small machines.\n"
    "llama.cpp loads GGUF files; transformers loads safetensors. 3.14 and 42 are numbers!\n"
    "A tokenizer splits text into pieces; each piece has an id, a score and a type.\n"
    "Byte fallback spells characters the vocabulary lacks as bytes: naïve café, 東京, 🦙.\n"
    "    Indented code: def f(x):\n        return x * 2  # a comment\n"
)
LINES = [line for line in (TEXT * 8).splitlines() if line.strip()]
SAMPLES = (
    "The quick brown fox",
    " jumps  over\tthe lazy dog.\n",
    "naïve café 東京 🦙 3333 ⌘",
    "[INST] Hello [/INST] <|user|>",
    "",
)
"""Texts the tests tokenize: spaces, tabs, a newline, characters out of the vocabulary (byte
fallback or <unk>), digits, chat markers."""

USER, CONTROL = ["<tool>", "\u2581fox"], ["<ctl>"]  # symbols trained into some models

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set "
    "system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% "
    "set system_message = false %}{% endif %}{% for message in loop_messages %}{% if "
    "(message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation "
    "roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 "
    "and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}"
    "{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + "
    "' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + "
    "eos_token }}{% endif %}{% endfor %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ "
    "'[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ "
    "message['content'] + eos_token + ' ' }}{% else %}{{ raise_exception('Only user and "
    "assistant roles are supported!') }}{% endif %}{% endfor %}"
)
TINYLLAMA_TEMPLATE = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + "
    "message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n{{ "
    "'<|system|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' "
    "%}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n{% if "
    "loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}"
)

_SPECIALS = {
    "0": {"content": "<unk>", "lstrip": False, "normalized": False, "rstrip": False,
          "single_word": False, "special": True},
    "1": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
          "single_word": False, "special": True},
    "2": {"content": "</s>", "lstrip": False, "normalized": False, "rstrip": False,
          "single_word": False, "special": True},
}  # fmt: skip

# config.json of each model with its sizes shrunk (the real ones in comments)
FLAVOURS: dict[str, dict[str, Any]] = {
    "llama2": {
        "arch": "llama", "template": LLAMA2_TEMPLATE, "pad": None,
        "config": {"hidden_size": 64, "intermediate_size": 172,  # 4096, 11008
                    "num_attention_heads": 4, "num_key_value_heads": 4,  # 32, 32
                    "num_hidden_layers": 2, "max_position_embeddings": 4096,  # 32
                    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False},
    },
    "mistral": {
        "arch": "mistral", "template": MISTRAL_TEMPLATE, "pad": None,
        "config": {"hidden_size": 64, "intermediate_size": 224,  # 4096, 14336
                    "num_attention_heads": 4, "num_key_value_heads": 1,  # 32, 8
                    "num_hidden_layers": 2, "max_position_embeddings": 32768,  # 32
                    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 4096,
                    "tie_word_embeddings": False},
    },
    "tinyllama": {
        "arch": "llama", "template": TINYLLAMA_TEMPLATE, "pad": "</s>",
        "config": {"hidden_size": 64, "intermediate_size": 176,  # 2048, 5632
                    "num_attention_heads": 8, "num_key_value_heads": 1,  # 32, 4
                    "num_hidden_layers": 2, "max_position_embeddings": 2048,  # 22
                    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False},
    },
}  # fmt: skip


def varint(n: int) -> bytes:
    """n as a protobuf varint (hand-made tokenizer.model files in the reliability tests)."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def train(
    model_type: str = "bpe", byte_fallback: bool = True, vocab_size: int = 400, **options: Any
) -> bytes:
    """A tokenizer.model trained on LINES with Llama 2's options (identity normalisation,
    digits split, whitespace kept, <unk> <s> </s> at 0 1 2, no pad)."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(LINES), model_writer=out, model_type=model_type,
        vocab_size=vocab_size, byte_fallback=byte_fallback, character_coverage=0.9995,
        normalization_rule_name="identity", split_digits=True, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, num_threads=1, minloglevel=2, **options,
    )  # fmt: skip
    return out.getvalue()


def write_sp_model(
    directory: Path, flavour: str = "llama2", *, vocab_size: int | None = None,
    model: bytes | None = None, tokenizer_json: bool = False,
) -> Path:  # fmt: skip
    """A tiny model of `flavour` (FLAVOURS) saved in `directory`: tokenizer.model (`model`, or
    one trained with train()), tokenizer_config.json as the real model's, config.json with
    vocab_size `vocab_size` (default: the tokenizer's size); with `tokenizer_json`, the
    tokenizer.json the real model ships beside it (write_tokenizer_json)."""
    import sentencepiece as spm
    import transformers

    spec = FLAVOURS[flavour]
    directory.mkdir(parents=True, exist_ok=True)
    model = train() if model is None else model
    (directory / "tokenizer.model").write_bytes(model)
    pieces = spm.SentencePieceProcessor(model_proto=model).vocab_size()
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_class, model_class = classes[spec["arch"]]
    torch.manual_seed(0)
    config = config_class(vocab_size=vocab_size or pieces, bos_token_id=1, eos_token_id=2,
                          **spec["config"])  # fmt: skip
    model_class(config).save_pretrained(directory)
    tokenizer_config = {
        "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": _SPECIALS,
        "bos_token": "<s>", "chat_template": spec["template"],
        "clean_up_tokenization_spaces": False, "eos_token": "</s>", "legacy": False,
        "model_max_length": 1000000000000000019884624838656, "pad_token": spec["pad"],
        "padding_side": "right", "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer",
        "unk_token": "<unk>", "use_default_system_prompt": False,
    }  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if spec["pad"]:
        special_map["pad_token"] = spec["pad"]
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    if tokenizer_json:
        write_tokenizer_json(directory, model)
    return directory


def write_tokenizer_json(directory: Path, model: bytes) -> None:
    """tokenizer.json as Llama 2's (transformers' LlamaConverter, legacy): BPE over the pieces
    with byte fallback, merges from the vocabulary (transformers' generate_merges, as its
    SentencePieceExtractor makes them), the Prepend/Replace normaliser, <s> prepended, the
    Replace/ByteFallback/Fuse/Strip decoder; <unk> <s> </s> added special tokens."""
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers.tokenization_utils_base import generate_merges

    sp = spm.SentencePieceProcessor(model_proto=model)
    vocab = {sp.IdToPiece(i): i for i in range(sp.vocab_size())}
    tok = Tokenizer(models.BPE(vocab, generate_merges(vocab), unk_token="<unk>",
                               fuse_unk=True, byte_fallback=True))  # fmt: skip
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])  # fmt: skip
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in ("<unk>", "<s>", "</s>")])  # fmt: skip
    tok.save(str(directory / "tokenizer.json"))


def vocab_digest(reader: Any) -> str:
    """sha256 of every tokenizer.* key as stored (name, type and value bytes, in file order)."""
    digest = sha256()
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            digest.update(b"".join(part.tobytes() for part in field.parts))
    return digest.hexdigest()


def build(root: Path, case: str) -> Path:
    """The directory of `case` (CASES) test_sp_vocab.GOLDEN was recorded from."""
    if case in ("llama2", "mistral", "tinyllama"):
        return write_sp_model(root / case, case, tokenizer_json=True)
    if case == "codellama":  # 32,016 ids: the converter's infill ids 32007-32010 on top
        return write_sp_model(root / case, "llama2", vocab_size=32016, tokenizer_json=True)
    if case == "unigram":
        model = train("unigram", False, 100, user_defined_symbols=USER, control_symbols=CONTROL)
        return write_sp_model(root / case, "llama2", model=model)
    # padded: config's vocab_size past the pieces, added tokens from both files, one past the
    # embedding, one replacing a byte piece
    src = write_sp_model(root / case, "tinyllama", vocab_size=416, tokenizer_json=True)
    added = {"<pad>": 400, "<tool\u2581call>": 401, "far": 999}
    (src / "added_tokens.json").write_text(json.dumps(added))
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"].update({
        "401": {"content": "<tool\u2581call>", "special": False},
        "402": {"content": "<|im_end|>", "special": False},
        "3": {"content": "<ctl>", "special": True},
    })  # fmt: skip
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    return src


CASES = ("llama2", "mistral", "tinyllama", "codellama", "unigram", "padded")
