"""llama.cpp's named mixes (`llama-quantize model.gguf out.gguf Q4_K_M`): the type llama-quantize
gives each tensor for a file type, transcribed from src/llama-quant.cpp (llama-cpp-python
0.3.36's vendored tree): llama_ftype_get_default_type, llama_tensor_get_type_impl's rules for
these file types (attn_v / attn_qkv / attn_kv_b, attn_k, attn_output, ffn_down, output and
token_embd; the counters over layers it keeps while walking the tensors in its order) and
tensor_type_fallback for rows that are not whole blocks. The IQ, TQ, MXFP4 and Q2_K_S mixes
are not here (qtool does not write their types). Torch-free.

    mix = MIXES["Q4_K_M"]
    types = mix_types(mix, header.tensors, ModelFacts.of(header.metadata))
    types["blk.0.attn_v.weight"]   # 'Q6_K'; tensors llama-quantize keeps are absent
    mix.ftype                      # 15: the general.file_type llama-quantize writes
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qtool.formats.gguf.plan import kept_by_llama, llama_order
from qtool.gguf_types import GGML_TYPES
from qtool.io.gguf_layout import GGUFTensorInfo, GGUFValue


@dataclass(frozen=True)
class Mix:
    """A llama.cpp file type: its name, llama_ftype value (general.file_type) and the type of
    every tensor no rule changes."""

    name: str
    ftype: int
    default: str


MIXES: dict[str, Mix] = {
    m.name: m
    for m in (
        Mix("Q4_0", 2, "Q4_0"), Mix("Q4_1", 3, "Q4_1"), Mix("Q8_0", 7, "Q8_0"),
        Mix("Q5_0", 8, "Q5_0"), Mix("Q5_1", 9, "Q5_1"), Mix("Q2_K", 10, "Q2_K"),
        Mix("Q3_K_S", 11, "Q3_K"), Mix("Q3_K_M", 12, "Q3_K"), Mix("Q3_K_L", 13, "Q3_K"),
        Mix("Q4_K_S", 14, "Q4_K"), Mix("Q4_K_M", 15, "Q4_K"), Mix("Q5_K_S", 16, "Q5_K"),
        Mix("Q5_K_M", 17, "Q5_K"), Mix("Q6_K", 18, "Q6_K"),
    )
}  # fmt: skip
"""The mixes by llama-quantize's name for them."""

# tensor_type_fallback: the 32-block type llama-quantize takes when rows are not whole blocks
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_BLK = re.compile(r"blk\.(\d+)\.")
# model types with LLM_TYPE_70B: architecture -> its layer count (llama: and GQA)
_SEVENTY_B = {"llama": 80, "deci": 80, "olmo": 80, "qwen2": 80, "jais2": 68}


@dataclass(frozen=True)
class ModelFacts:
    """What llama_tensor_get_type_impl reads of the model: its architecture, block count, heads
    (n_gqa = n_head / n_head_kv of layer 0) and experts."""

    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int = 0

    @classmethod
    def of(cls, metadata: Mapping[str, GGUFValue]) -> ModelFacts:
        """From a GGUF's metadata ({arch}.block_count, .attention.head_count[_kv] (the first of
        an array), .expert_count); ValueError when the architecture or block count is missing."""
        arch = _value(metadata, "general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ValueError("general.architecture is missing")
        n_layer = _int(metadata, f"{arch}.block_count")
        if n_layer is None:
            raise ValueError(f"{arch}.block_count is missing")
        if n_layer < 1:
            raise ValueError(f"{arch}.block_count is {n_layer}; a model has at least one block")
        n_head = _int(metadata, f"{arch}.attention.head_count") or 0
        n_head_kv = _int(metadata, f"{arch}.attention.head_count_kv")
        n_expert = _int(metadata, f"{arch}.expert_count") or 0
        return cls(arch, n_layer, n_head, n_head if n_head_kv is None else n_head_kv, n_expert)

    def check_blocks(self, tensors: Sequence[GGUFTensorInfo]) -> None:
        """ValueError unless the tensors' blocks (the highest blk.N + 1) are n_layer: the rules
        count layers against it (llama-quantize asserts the same of its attn_v count)."""
        blocks = max((int(m[1]) + 1 for t in tensors if (m := _BLK.match(t.name))), default=0)
        if blocks != self.n_layer:
            named = f"blocks 0 to {blocks - 1}" if blocks else "no block (no blk.N tensor)"
            raise ValueError(
                f"{self.arch}.block_count is {self.n_layer}, but its tensors name {named} "
                f"({blocks}); the header does not match its tensors (is the file intact?)"
            )

    @property
    def n_gqa(self) -> int:
        return 0 if self.n_head_kv == 0 else self.n_head // self.n_head_kv

    @property
    def is_70b(self) -> bool:
        layers = _SEVENTY_B.get(self.arch)
        if layers is None or self.n_layer != layers:
            return False
        return self.arch != "llama" or self.n_head != self.n_head_kv


def _value(metadata: Mapping[str, GGUFValue], key: str) -> object:
    found = metadata.get(key)
    return None if found is None else found.value


def _int(metadata: Mapping[str, GGUFValue], key: str) -> int | None:
    v = _value(metadata, key)
    if isinstance(v, (list, tuple)):
        v = v[0] if v else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def category(name: str) -> str:
    """tensor_get_category: output, token_embd, attn_qkv, attn_kv_b, attn_v, attn_k, attn_q,
    attn_output, ffn_up, ffn_gate, ffn_down or other, by the first fragment `name` holds."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for fragment, cat in (
        ("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"),
        ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):  # fmt: skip
        if fragment in name:
            return cat
    return "other"


# category_is_attn_v: attn_qkv takes this branch, never its own later one in the C
_ATTN_V = ("attn_v", "attn_qkv", "attn_kv_b")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


class _Walk:
    """llama_tensor_get_type_impl's state over one walk of the tensors (quantize_state_impl)."""

    def __init__(self, mix: Mix, facts: ModelFacts, names: Sequence[str], imatrix: bool) -> None:
        self.mix, self.facts, self.imatrix = mix.name, facts, imatrix
        cats = [category(n) for n in names]
        self.n_attention_wv = sum(c in _ATTN_V for c in cats)
        self.tied = "output" not in cats
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0

    def layer(self, counter: int, name: str) -> tuple[int, int]:
        """layer_info: the counter, or with experts the layer the name says."""
        n_layer = self.facts.n_layer
        if max(1, self.facts.n_expert) > 1:
            found = re.match(r"blk\.(-?\d+)\.", name)
            if found is None:
                raise ValueError(f"Failed to determine layer for tensor {name}")
            i_layer = int(found[1])
            if not 0 <= i_layer < n_layer:
                raise ValueError(
                    f"Bad layer {i_layer} for tensor {name}. Must be in [0, {n_layer})"
                )
            return i_layer, n_layer
        return counter, n_layer

    def type_of(self, name: str, nx: int, new: str) -> str:  # noqa: C901, PLR0912
        """llama_tensor_get_type_impl for this mix (the branches of other file types left out)."""
        ftype, facts, cat = self.mix, self.facts, category(name)
        falcon = facts.arch == "falcon"
        if facts.arch == "glm5-next" and any(
            s in name for s in ("attn_q_a", "attn_q_b", "nextn.eh_proj")
        ):
            return new if new in ("F32", "BF16", "F16") else "Q8_0"
        if cat == "output" or (self.tied and cat == "token_embd"):
            if falcon or nx % GGML_TYPES[new].block_size:
                new = "Q8_0"
            elif new != "Q8_0":
                new = "Q6_K"
        elif cat == "token_embd":
            pass
        elif cat in _ATTN_V:
            i, n = self.i_attention_wv, self.n_attention_wv
            if ftype == "Q2_K":
                new = "Q4_K" if facts.n_gqa >= 4 else "Q3_K"
            elif ftype == "Q3_K_M":
                new = "Q5_K" if i < 2 else "Q4_K"
            elif ftype == "Q3_K_L":
                new = "Q5_K"
            elif ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
                new = "Q6_K"
            elif ftype == "Q4_K_S" and i < 4:
                new = "Q5_K"
            if facts.is_70b and new in ("Q3_K", "Q4_K"):
                new = "Q5_K"
            if facts.n_expert == 8:
                new = "Q8_0"
            self.i_attention_wv += 1
        elif cat == "attn_k":
            if facts.n_expert == 8:
                new = "Q8_0"
        elif cat == "ffn_down":
            i, n = self.layer(self.i_ffn_down, name)
            if ftype == "Q2_K":
                new = "Q3_K"
            elif ftype == "Q3_K_M":
                new = (
                    "Q5_K" if i < n // 16
                    else "Q4_K" if not falcon or use_more_bits(i, n)
                    else "Q3_K"
                )  # fmt: skip
            elif ftype == "Q3_K_L":
                new = "Q4_K" if falcon else "Q5_K"
            elif ftype == "Q4_K_M":
                if falcon:
                    new = "Q6_K" if i < n // 16 else "Q5_K" if use_more_bits(i, n) else "Q4_K"
                elif use_more_bits(i, n):
                    new = "Q6_K"
            elif ftype == "Q5_K_M" and use_more_bits(i, n):
                new = "Q6_K"
            elif ftype == "Q4_K_S" and not falcon and i < n // 8:
                new = "Q5_K"
            elif ftype in ("Q4_0", "Q5_0") and self.imatrix and i < n // 8:
                new = "Q4_1" if ftype == "Q4_0" else "Q5_1"
            self.i_ffn_down += 1
        elif cat == "attn_output":
            if not falcon:
                if facts.n_expert == 8:
                    if ftype in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M"):
                        new = "Q5_K"
                else:
                    new = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(ftype, new)
            elif ftype == "Q3_K_L":
                new = "Q4_K"
        elif cat == "ffn_gate":
            self.layer(self.i_ffn_gate, name)
            self.i_ffn_gate += 1
        elif cat == "ffn_up":
            self.layer(self.i_ffn_up, name)
            self.i_ffn_up += 1
        return new


def fallback(qtype: str, nx: int) -> str:
    """tensor_type_fallback: `qtype`, or for rows of nx that are not whole blocks the 32-block
    type llama-quantize takes instead, or F16 where that does not fit either."""
    if nx % GGML_TYPES[qtype].block_size == 0:
        return qtype
    other = _FALLBACK.get(qtype, qtype)
    return other if nx % GGML_TYPES[other].block_size == 0 else "F16"


def mix_types(
    mix: Mix,
    tensors: Sequence[GGUFTensorInfo],
    facts: ModelFacts,
    *,
    imatrix: bool = False,
    wanted: dict[str, str] | None = None,
) -> dict[str, str]:
    """The type llama-quantize writes for each tensor it quantizes in `mix` (tensors it keeps
    as they are absent), walking them in its order; `imatrix`: it was given an importance
    matrix (Q4_0/Q5_0 then give the first eighth of ffn_down Q4_1/Q5_1); `wanted`, when given,
    gets the mix's type of each tensor whose rows made it fall back to another."""
    by_name = {t.name: t for t in tensors}
    names = llama_order(list(by_name))
    walk = _Walk(mix, facts, names, imatrix)
    out: dict[str, str] = {}
    for name in names:
        info = by_name[name]
        if kept_by_llama(name, info.shape, facts.arch) is not None:
            continue
        nx = info.shape[0] if info.shape else 1
        asked = walk.type_of(name, nx, mix.default)
        out[name] = fallback(asked, nx)
        if wanted is not None and out[name] != asked:
            wanted[name] = asked
    return out
