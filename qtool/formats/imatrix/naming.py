"""llama.cpp's names for a Hugging Face checkpoint's weights, as its converter
(convert_hf_to_gguf.py) names them: what an importance matrix computed on the Hugging Face model
must be keyed by for llama-quantize to find its entries in the GGUF of the same model.

    names = llama_names("llama", 30, ["model.layers.0.self_attn.q_proj.weight", ...])
    # {"model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight", ...}
"""

from __future__ import annotations

from collections.abc import Sequence

# transformers' model_type -> the llama.cpp architecture its converter writes (Mistral-style
# checkpoints are converted as llama: same tensors, same names)
GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# mixture-of-experts models an importance matrix is computed for and read with (not the
# calibrated methods): Mixtral is converted as llama, its experts stacked into *_exps weights
MOE_ARCHS = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
IMATRIX_ARCHS = GGUF_ARCHS | MOE_ARCHS


def llama_names(arch: str, n_blocks: int, hf_names: Sequence[str]) -> dict[str, str]:
    """Hugging Face name -> llama.cpp name for each of `hf_names` gguf-py's name map places,
    for a model of llama.cpp architecture `arch` with `n_blocks` blocks (UsageError without
    the gguf package). ValueError for more blocks than llama.cpp loads."""
    from qtool.formats.gguf.names import MAX_BLOCKS, gguf_names

    if not 0 <= n_blocks <= MAX_BLOCKS:
        raise ValueError(f"{n_blocks} blocks: llama.cpp loads models of 0 to {MAX_BLOCKS}")
    return gguf_names(arch, n_blocks, hf_names)


def fused_expert_entry(gguf_name: str) -> str | None:
    """The entry an imatrix of a GGUF converted with `convert_hf_to_gguf.py --fuse-gate-up-exps`
    holds the stacked gate or up weight `gguf_name` under (blk.N.ffn_gate_up_exps.weight: gate
    and up of an expert take the same input, so row e weighs both), None for other names."""
    for stacked in (".ffn_gate_exps.", ".ffn_up_exps."):
        if stacked in gguf_name:
            return gguf_name.replace(stacked, ".ffn_gate_up_exps.")
    return None


def llama_expert_names(
    arch: str, n_blocks: int, hf_names: Sequence[str]
) -> dict[str, tuple[str, int]]:
    """For each of `hf_names` that is one expert's Linear of a checkpoint storing its experts
    apart, llama.cpp's name of the stacked weight its converter merges them into and the
    expert's index (formats/gguf/names.expert_names). ValueError for more blocks than llama.cpp
    loads."""
    from qtool.formats.gguf.names import MAX_BLOCKS, expert_names

    if not 0 <= n_blocks <= MAX_BLOCKS:
        raise ValueError(f"{n_blocks} blocks: llama.cpp loads models of 0 to {MAX_BLOCKS}")
    return expert_names(arch, n_blocks, hf_names)
