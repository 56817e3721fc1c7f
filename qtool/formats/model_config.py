"""The size model of a config.json: what the counts in it make a consumer build, checked
against the weights present before anything is built.

A model class builds one block per layer and one expert module per expert, as config.json
says: `num_hidden_layers: 200000` in a 400-byte file makes transformers build 200,000 decoder
layers (minutes, gigabytes), `vision_config.depth: 100000` as many vision blocks. Every such
count (BUILD_COUNTS, in the config and in its sub-configs: `text_config`, `vision_config`, ...)
must be backed by the checkpoint: a block or expert that owns no tensor exists only where
layers share weights (ALBERT) or experts are fused into one 3-D tensor, so

- each count is at most the checkpoint's units (its tensors, or the leading dimension of a
  fused 3-D+ tensor, whichever is more), or MIN_UNITS for tiny checkpoints; and
- the modules one (sub-)config builds, the product of its counts (layers x experts), summed
  over the sub-configs, are at most MODULES_PER_TENSOR times the tensors (or MIN_MODULES).

A count beyond that is refused with one line naming config.json, the key and what the weights
hold, before any model is built. Used by `qtool eval` (before transformers builds FLOAT) and by
the compressed-tensors export (before it builds the model on the meta device). Torch-free.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from qtool.errors import InputError

BUILD_COUNTS = re.compile(
    r"^(num_hidden_layers|num_layers|n_layers?|depth|num_blocks|num_hidden_blocks"
    r"|(encoder|decoder)_layers|num_(encoder|decoder)_layers"
    r"|num_experts|num_local_experts|n_routed_experts|moe_num_experts|n_experts)$"
)
"""Keys whose value is a number of modules a model class builds (`max_window_layers`,
`num_experts_per_tok`, `first_k_dense_replace` build nothing)."""
NEEDS_ONE = re.compile(r"^(num_hidden_layers|num_layers|n_layers?)$")
"""Build counts a model needs at least one of (zero layers is no model: `num_hidden_layers: 0`
or `-1` ran eval with no block at all, KL 0). Other build counts may be 0, never negative."""
POSITIVE = re.compile(
    r"^(num_attention_heads|num_key_value_heads|n_heads?|num_heads|attention_heads"
    r"|(encoder|decoder)_attention_heads|head_dim)$"
)
"""Sizes transformers divides by or raises to a negative power: 0 was `ZeroDivisionError:
integer modulo by zero` or `0.0 cannot be raised to a negative power`, naming nothing."""
MIN_UNITS = 64
"""Any count up to this is allowed, whatever the checkpoint (a few blocks cost nothing)."""
MODULES_PER_TENSOR = 8
MIN_MODULES = 4096
MAX_SUBCONFIG_DEPTH = 4
_NUMBERED = re.compile(r"\.(\d+)(?=\.|$)")


def check_counts(
    config: Mapping[str, object], path: Path | None, shapes: Mapping[str, Sequence[int]]
) -> None:
    """InputError naming `path` (config.json) and the key when a count of `config` asks for
    more modules than the checkpoint's tensors (`shapes`, name -> shape) can back."""
    check_positive(config, path)
    tensors = len(shapes)
    units = max(MIN_UNITS, tensors, *(s[0] for s in shapes.values() if len(s) >= 3))
    modules = 0
    for where, counts in _counts(config):
        for key, value in counts:
            if value > units:
                raise InputError(
                    path, f"{where}{key} is {value:,}, but the checkpoint holds "
                    f"{_held(shapes)}; refusing to build a model the weights do not describe "
                    "(fix the count in config.json)",
                )  # fmt: skip
        modules += math.prod(v for _, v in counts)
    bound = max(MIN_MODULES, MODULES_PER_TENSOR * tensors)
    if modules > bound:
        keys = ", ".join(f"{w}{k} {v:,}" for w, c in _counts(config) for k, v in c)
        raise InputError(
            path, f"its counts ({keys}) make {modules:,} modules, but the checkpoint holds "
            f"{_held(shapes)}; refusing to build a model the weights do not describe",
        )  # fmt: skip


_DECODER_LAYER = re.compile(r"^(?:model|transformer)\.(?:layers|h)\.(\d+)\.")


def check_layer_indices(
    config: Mapping[str, object], path: Path | None, names: Sequence[str]
) -> None:
    """InputError naming `path` and num_hidden_layers when a tensor of a decoder's layer list
    (`model.layers.N.`, `transformer.h.N.`) has an index N the count leaves out: a model built
    from config.json would not have that layer, and its tensors would be taken for something
    else (the export listed them as "kept: not an nn.Linear in transformers"). The layers a
    model appends for multi-token prediction (DeepSeek-V3's and GLM-4.5's
    `num_nextn_predict_layers`, which transformers ignores on load) are its own."""
    count = config.get("num_hidden_layers")
    if type(count) is not int:
        return
    extra = config.get("num_nextn_predict_layers")
    last = count + (extra if type(extra) is int and extra > 0 else 0)
    for name in names:
        m = _DECODER_LAYER.match(name)
        if m and int(m.group(1)) >= last:
            raise InputError(
                path, f"num_hidden_layers is {count:,}, but the checkpoint holds {name} (layer "
                f"{m.group(1)}); fix the count in config.json",
            )  # fmt: skip


def check_positive(config: Mapping[str, object], path: Path | None) -> None:
    """InputError naming `path` and the key when a count or size is below what any model needs
    (NEEDS_ONE and POSITIVE at least 1, other BUILD_COUNTS at least 0)."""
    for where, doc in _subconfigs(config):
        for key, value in doc.items():
            if type(value) is not int:
                continue
            least = 1 if NEEDS_ONE.match(key) or POSITIVE.match(key) else 0
            if value < least and (least or BUILD_COUNTS.match(key)):
                raise InputError(
                    path, f"{where}{key} is {value:,}; a model needs {least} or more (fix it "
                    "in config.json)",
                )  # fmt: skip


def _subconfigs(
    doc: Mapping[str, object], where: str = "", depth: int = 0
) -> Iterator[tuple[str, Mapping[str, object]]]:
    """(key path, sub-config) for the config and each sub-config, MAX_SUBCONFIG_DEPTH deep."""
    yield where, doc
    if depth < MAX_SUBCONFIG_DEPTH:
        for key, value in doc.items():
            if isinstance(value, dict):
                yield from _subconfigs(value, f"{where}{key}.", depth + 1)


def _counts(
    doc: Mapping[str, object], where: str = "", depth: int = 0
) -> Iterator[tuple[str, list[tuple[str, int]]]]:
    """(the sub-config's key path, its positive build counts) for the config and each
    sub-config, at most MAX_SUBCONFIG_DEPTH levels down."""
    counts = [
        (key, value)
        for key, value in doc.items()
        if BUILD_COUNTS.match(key) and type(value) is int and value > 0
    ]
    if counts:
        yield where, counts
    if depth < MAX_SUBCONFIG_DEPTH:
        for key, value in doc.items():
            if isinstance(value, dict):
                yield from _counts(value, f"{where}{key}.", depth + 1)


def _held(shapes: Mapping[str, Sequence[int]]) -> str:
    """What the checkpoint holds, for messages: its tensors and its longest numbered run of
    modules (`model.layers.0` to `model.layers.1`: 2 layers)."""
    runs: dict[str, set[int]] = {}
    for name in shapes:
        for m in _NUMBERED.finditer(name):
            runs.setdefault(name[: m.start()], set()).add(int(m.group(1)))
    text = f"{len(shapes):,} tensors"
    if runs:
        prefix, indices = max(runs.items(), key=lambda item: len(item[1]))
        text += f" (at most {len(indices):,} numbered modules, under {prefix})"
    return text


def untied(config: Mapping[str, object]) -> bool:
    """Whether config.json says the output head is not tied to the embedding
    (`tie_word_embeddings: false`, at the top or in `text_config`)."""
    tied = config.get("tie_word_embeddings")
    text = config.get("text_config")
    if tied is None and isinstance(text, Mapping):
        tied = text.get("tie_word_embeddings")
    return tied is False
