"""config.json of a Hugging Face model directory checked before the GGUF export uses it: each
key the export reads, with its type and range (`check_config`), then against the shapes of the
checkpoint's tensors (`check_shapes`). A value of the wrong type reached gguf-py's writer or
torch as an internal error; a value contradicting the tensors (a block count, a head size) wrote
a GGUF llama.cpp refuses or, worse, runs wrongly. Every refusal: `KEY is ..., expected ...`,
naming config.json.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qtool.errors import InputError

UINT32_MAX = 2**32 - 1  # the GGUF type of every count and length the export writes
_BLOCK = re.compile(r"^model\.layers\.(\d+)\.")

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_OPTIONAL = ("num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")


def check_config(config: dict[str, Any], path: Path) -> None:
    """Every key the export reads has its type and range; InputError naming the first that
    does not."""
    for key in _REQUIRED:
        _count(config, key, path, required=True)
    for key in _OPTIONAL:
        _count(config, key, path, required=False)
    _real(config, "rms_norm_eps", path)
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads")
    if kv is not None and heads % kv:
        raise InputError(path, f"num_key_value_heads is {kv}, expected a divisor of "
                         f"num_attention_heads ({heads})")  # fmt: skip
    hidden = config["hidden_size"]
    if config.get("head_dim") is None and hidden % heads:
        raise InputError(path, f"num_attention_heads is {heads}, expected a divisor of "
                         f"hidden_size ({hidden}) when there is no head_dim")  # fmt: skip
    _rope(config, path)


def head_dim(config: dict[str, Any]) -> int:
    """Each attention head's size: head_dim, else hidden_size / num_attention_heads."""
    found = config.get("head_dim")
    return (
        int(found) if found is not None else config["hidden_size"] // config["num_attention_heads"]
    )


def check_shapes(
    config: dict[str, Any], shapes: Sequence[tuple[str, tuple[int, ...]]], path: Path
) -> None:
    """config.json against the tensors (Hugging Face names, torch shapes): as many blocks as
    num_hidden_layers, and every tensor of the Llama family (embedding, projections, biases,
    norms, head) of the rank and sizes the config gives it: GGUF loaders take the sizes from
    the config and refuse a tensor that differs."""
    blocks = {int(m.group(1)) for name, _ in shapes if (m := _BLOCK.match(name))}
    n = config["num_hidden_layers"]
    if blocks != set(range(n)):
        held = f"blocks {min(blocks)} to {max(blocks)} ({len(blocks)})" if blocks else "no blocks"
        raise InputError(path, f"num_hidden_layers is {n}, expected the checkpoint's block "
                         f"count: its tensors hold {held}")  # fmt: skip
    expected = _expected_shapes(config)
    for name, shape in shapes:
        suffix = name.split(".", 3)[-1] if _BLOCK.match(name) else name
        if suffix in expected:
            _check_shape(name, shape, expected[suffix], path)
    dim = head_dim(config)
    if dim % 2:  # rotary embeddings rotate pairs (and the converter permutes q/k by them)
        raise InputError(path, f"head_dim is {dim}, expected an even number (rotary pairs)")


_Dim = tuple[str, int | None]  # the config's name for a size, and the size (None: not given)


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[_Dim, ...]]:
    """Each tensor's shape as the config gives it, by name (a block's without its prefix)."""
    heads, dim = config["num_attention_heads"], head_dim(config)
    kv = config.get("num_key_value_heads") or heads
    hidden: _Dim = ("hidden_size", config["hidden_size"])
    vocab: _Dim = ("vocab_size", config["vocab_size"])
    q: _Dim = ("num_attention_heads x head_dim", heads * dim)
    kv_rows: _Dim = ("num_key_value_heads x head_dim", kv * dim)
    ff: _Dim = ("intermediate_size", config.get("intermediate_size"))
    return {
        "model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
        "model.norm.weight": (hidden,), "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q, hidden), "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.weight": (kv_rows, hidden), "self_attn.k_proj.bias": (kv_rows,),
        "self_attn.v_proj.weight": (kv_rows, hidden), "self_attn.v_proj.bias": (kv_rows,),
        "self_attn.o_proj.weight": (hidden, q), "self_attn.o_proj.bias": (hidden,),
        "mlp.gate_proj.weight": (ff, hidden), "mlp.gate_proj.bias": (ff,),
        "mlp.up_proj.weight": (ff, hidden), "mlp.up_proj.bias": (ff,),
        "mlp.down_proj.weight": (hidden, ff), "mlp.down_proj.bias": (hidden,),
    }  # fmt: skip


def _check_shape(name: str, shape: tuple[int, ...], want: tuple[_Dim, ...], path: Path) -> None:
    """`name`'s shape against the config's `want`: its rank, then each size the config gives."""
    if len(shape) != len(want):
        sizes = ", ".join(f"{value:,}" if value is not None else key for key, value in want)
        keys = ", ".join(key for key, _ in want)
        raise InputError(path, f"{name} is {list(shape)}, expected [{sizes}] ({keys}): not "
                         "the tensor this config describes")  # fmt: skip
    axes = ("rows", "columns") if len(want) == 2 else ("values",)
    for size, (key, value), axis in zip(shape, want, axes, strict=True):
        if value is not None and size != value:
            raise InputError(path, f"{key} is {value:,}, expected {name}'s {size:,} "
                             f"{axis}")  # fmt: skip


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """transformers' rope parameters: `rope_parameters` (v5), else rope_scaling and rope_theta."""
    found = config.get("rope_parameters")
    if isinstance(found, dict):
        return found
    params = dict(config.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    if config.get("rope_theta") is not None:
        params["rope_theta"] = config["rope_theta"]
    return params


def _count(config: dict[str, Any], key: str, path: Path, *, required: bool) -> None:
    value = config.get(key)
    if value is None and not required:
        return
    if type(value) is not int or not 0 < value <= UINT32_MAX:
        raise InputError(path, f"{key} is {value!r}, expected an integer from 1 to {UINT32_MAX:,}")


def _real(config: dict[str, Any], key: str, path: Path, *, within: dict[str, Any] | None = None,
          name: str | None = None) -> None:  # fmt: skip
    """A positive finite number (int or float, not a bool) or absent."""
    value = (within if within is not None else config).get(key)
    if value is None:
        return
    if type(value) not in (int, float) or not (math.isfinite(value) and value > 0):
        raise InputError(path, f"{name or key} is {value!r}, expected a positive number")


def _rope(config: dict[str, Any], path: Path) -> None:
    """rope_theta and the rope scaling's numbers (rope_scaling or rope_parameters)."""
    _real(config, "rope_theta", path)
    for where in ("rope_scaling", "rope_parameters"):
        found = config.get(where)
        if found is not None and not isinstance(found, dict):
            raise InputError(path, f"{where} is {found!r}, expected an object")
    rope = rope_parameters(config)
    for key in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor"):
        _real(config, key, path, within=rope, name=f"rope {key}")
    kind = rope.get("rope_type")
    if kind is not None and not isinstance(kind, str):
        raise InputError(path, f"rope_type is {kind!r}, expected a string")
    orig = rope.get("original_max_position_embeddings")
    if kind == "yarn" and rope.get("factor") is not None and orig is None:
        raise InputError(path, "rope scaling yarn has no original_max_position_embeddings, "
                         "expected the context length it was trained at")  # fmt: skip
    if orig is not None:
        _count(rope, "original_max_position_embeddings", path, required=True)
