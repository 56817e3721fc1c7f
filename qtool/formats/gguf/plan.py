"""What llama-quantize does with each tensor of a float GGUF, transcribed from llama.cpp's
src/llama-quant.cpp (llama-cpp-python 0.3.36's vendored tree): which tensors it keeps as they
are (tensor_allows_quantization), the type it writes when rows are not whole blocks
(tensor_type_fallback: gguf_types.fallback_type), the order it writes tensors in (its
weights_map: by layer, then by name), and the general.file_type it records. qtool's per-tensor
types replace llama-quantize's hand-made mixes (as `llama-quantize --pure` with --tensor-type
for every tensor); everything else is as it does. Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from qtool.formats.gguf.ftype import guess_ftype
from qtool.gguf_types import FLOAT_TYPES, GGMLType
from qtool.io.gguf_layout import GGUFTensorInfo
from qtool.spec import Codec, GGUFSpec, gguf_stored_type

# name fragments llama-quantize never quantizes (tensor_allows_quantization), with why
_KEPT_FRAGMENTS: tuple[tuple[str, str], ...] = (
    ("_norm.weight", "a norm"),
    ("ffn_gate_inp.weight", "an expert gate"),
    ("ffn_gate_tid2eid.weight", "a routing table"),
    ("altup", "tiny (altup)"),
    ("laurel", "tiny (laurel)"),
    ("per_layer_model_proj", "small (per_layer_model_proj)"),
    ("ssm_conv1d", "a small conv1d"),
    ("shortconv.conv.weight", "a small conv1d"),
    ("indexer.k_proj.weight", "a tiny indexer projection"),
    ("indexer.q_proj.weight", "a tiny indexer projection"),
    *((f"time_mix_{w}.weight", "a small RWKV weight") for w in (
        "first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2", "g1", "g2", "decay_w1",
        "decay_w2", "lerp_fused")),
    ("attn_rel_b.weight", "a relative position bias"),
    (".position_embd", "a multimodal position embedding"),
    ("sam.pos_embd", "a multimodal position embedding"),
    ("sam.neck.", "a multimodal tensor"),
    ("sam.net_", "a multimodal tensor"),
    (".rel_pos", "a multimodal tensor"),
    (".patch_embd", "a multimodal tensor"),
    (".patch_merger", "a multimodal tensor"),
    ("a.rvq.codebook", "an audio codebook"),
    ("mm.a.code_embd", "an audio codebook"),
)  # fmt: skip
_GLM5_NEXT_KEPT = (
    "hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate",
    "indexer_compressor_ape", "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight",
    "ssm_g_b.weight", "ssm_beta.weight", "attn_kv_a_mqa.weight", "attn_k_b.weight",
    "attn_v_b.weight",
)  # fmt: skip
_EXACT_KEPT = {"position_embd.weight": "a position embedding",
               "token_types.weight": "token type embeddings"}  # fmt: skip


def ggml_n_dims(shape: Sequence[int]) -> int:
    """ggml_n_dims: dimensions up to the last one longer than 1 (GGUF order), at least 1."""
    return max((i + 1 for i, d in enumerate(shape) if d > 1), default=1)


def kept_by_llama(name: str, shape: Sequence[int], arch: str) -> str | None:
    """Why llama-quantize keeps tensor `name` (GGUF `shape`) as it is; None if it quantizes it."""
    if ggml_n_dims(shape) < 2:
        return "1-D: llama.cpp keeps it in float"
    if not name.endswith("weight"):
        return "not a weight: llama.cpp keeps it in float"
    if name in _EXACT_KEPT:
        return f"{_EXACT_KEPT[name]}: llama.cpp keeps it in float"
    for fragment, what in _KEPT_FRAGMENTS:
        if fragment in name:
            return f"{what}: llama.cpp keeps it in float"
    if arch == "glm5-next" and any(f in name for f in _GLM5_NEXT_KEPT):
        return "llama.cpp keeps it in float for glm5-next"
    return None


def llama_order(names: Sequence[str]) -> list[str]:
    """llama-quantize's tensor order (weights_map's weight_name_comparer): by the layer number
    of `blk.N.` names (others first), then by name."""
    return sorted(names, key=lambda n: (_layer(n), n))


def _layer(name: str) -> int:
    found = re.match(r"blk\.(-?\d+)\.", name)  # sscanf("blk.%d.") reads a sign too
    return int(found[1]) if found else -1


@dataclass(frozen=True)
class TensorChoice:
    """One tensor of the output: `stored` is its type in the file; `spec` what was asked (None:
    kept as it is, `reason` says why); `note` how the ask was adapted (a fallback)."""

    info: GGUFTensorInfo
    stored: GGMLType
    spec: Codec | None
    reason: str = ""
    note: str = ""

    @property
    def quantized(self) -> bool:
        return self.stored != self.info.type


def choose(
    tensors: Sequence[GGUFTensorInfo],
    asked: Mapping[str, Codec | None] | Callable[[GGUFTensorInfo], Codec | None],
    arch: str,
) -> list[TensorChoice]:
    """Each tensor's type in llama-quantize's order, given the GGUF spec asked for each (None or
    absent: keep). A tensor llama.cpp keeps stays as it is whatever was asked; a tensor whose
    rows are not whole blocks gets llama-quantize's fallback (or F16)."""
    ask = asked if callable(asked) else (lambda info: asked.get(info.name))
    by_name = {t.name: t for t in tensors}
    return [_choice(by_name[n], ask(by_name[n]), arch) for n in llama_order(list(by_name))]


def _choice(info: GGUFTensorInfo, spec: Codec | None, arch: str) -> TensorChoice:
    if spec is None:
        return TensorChoice(info, info.type, None, "not asked to be quantized")
    if not isinstance(spec, GGUFSpec):
        raise ValueError(f"{info.name}: {spec.describe()} is not a GGUF type")
    why = kept_by_llama(info.name, info.shape, arch)
    if why is not None:
        return TensorChoice(info, info.type, None, why)
    if info.type.name not in FLOAT_TYPES:
        why = f"already {info.type.name}: qtool quantizes F32, F16 and BF16 tensors only"
        return TensorChoice(info, info.type, None, why)
    stored = gguf_stored_type(spec, info.torch_shape)
    note = ""
    if stored != spec.gguf:
        note = f"fallback: rows of {info.shape[0]} are not whole {spec.gguf.name} blocks"
    return TensorChoice(info, stored, spec, "", note)


def file_type(choices: Sequence[TensorChoice], before: int | None) -> int | None:
    """general.file_type of the output: llama.cpp's guess (the type of the most tensors) over
    the tensors qtool quantized, in llama-quantize's order; `before` when none was."""
    types = [c.stored.name for c in choices if c.quantized]
    return guess_ftype(types) if types else before
