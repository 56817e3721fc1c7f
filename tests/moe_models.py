"""Tiny mixture-of-experts models for the importance-matrix tests, built offline from real
configs shrunk (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE) with a fixed seed and
saved as transformers saves them: one Linear per expert on disk
(`block_sparse_moe.experts.E.w1/w2/w3`, `mlp.experts.E.gate_proj/up_proj/down_proj`), which
transformers fuses into 3-D `experts.gate_up_proj` / `experts.down_proj` when it loads them.
With eval_models' byte-level tokenizer. Needs transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.eval_models import VOCAB, save_tokenizer

EXPERTS = 4
KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")
# the text of llama-imatrix's recorded file (scripts/moe_imatrix_oracle.py): 8 chunks of 32
ORACLE_TEXT = " ".join(
    f"alpha {i} beta {i * 7 % 13} gamma. Delta{i}: epsilon {i % 5}!" for i in range(60)
)
ORACLE_CTX, ORACLE_CHUNKS = 32, 8


def build_moe(directory: Path, kind: str, layers: int = 2, seed: int = 0) -> Path:
    """Save the tiny MoE model `kind` (one of KINDS) with its tokenizer into `directory`."""
    import transformers

    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
        "num_experts_per_tok": 2, "tie_word_embeddings": False,
    }  # fmt: skip
    model: Any
    if kind == "mixtral":
        cfg: Any = transformers.MixtralConfig(
            **common, intermediate_size=96, num_local_experts=EXPERTS
        )
        model = transformers.MixtralForCausalLM(cfg)
    elif kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=64, num_experts=EXPERTS,
            shared_expert_intermediate_size=96,
        )  # fmt: skip
        model = transformers.Qwen2MoeForCausalLM(cfg)
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **(common | {"head_dim": 16}), intermediate_size=96, moe_intermediate_size=64,
            num_experts=EXPERTS,
        )  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(f"no tiny MoE model {kind!r}")
    with torch.no_grad():  # routers of std 0.2 route every token alike: spread them
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    model.to(torch.bfloat16).eval().save_pretrained(directory)
    save_tokenizer(directory, encoder=False)
    return directory
