"""FLOAT, the reference model: a Hugging Face model directory checked by qtool (found by
`detect`; config.json and the safetensors headers read through the directory's descriptor,
strictly, and refused when already quantized) and then loaded by transformers, once, in the
compute dtype."""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qtool.engine.model import hf
from qtool.engine.model.config import FLOAT, Role, float_source, kind_of
from qtool.engine.model.experts import (
    expert_linear_shape,
    router_name,
    routing_problem,
    stacked_experts,
    stored_apart,
)
from qtool.engine.model.readers import read_tensors
from qtool.engine.source import Source
from qtool.errors import InputError
from qtool.eval_results import CAUSAL_LM
from qtool.formats import stale_config
from qtool.formats.detect import CONFIG, Detected, refuse_quantized
from qtool.formats.model_config import check_counts
from qtool.io.stformat import HeaderError


@dataclass(frozen=True)
class Checkpoint:
    """The tensors a checkpoint holds: name -> (shape, safetensors dtype), and the file of
    each (for messages)."""

    tensors: dict[str, tuple[tuple[int, ...], str]]
    files: dict[str, Path] = field(default_factory=dict)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (shape, _) in self.tensors.items()}


@dataclass(frozen=True)
class FloatModel:
    path: Path
    architecture: str
    kind: str  # CAUSAL_LM or ENCODER
    model: Any  # a transformers PreTrainedModel, in eval mode, in the compute dtype
    tokenizer: hf.Tokenizer
    checkpoint: Checkpoint
    unexpected: frozenset[str]  # checkpoint tensors the architecture does not use (a head)


def read_checkpoint(found: Detected) -> Checkpoint:
    """The tensors of a model directory's safetensors (headers only, read through the
    directory's descriptor; a quantized one refused)."""
    source = Source(found)
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    files: dict[str, Path] = {}
    for shard in source.shards:
        try:
            header = source.header(shard)
        except HeaderError as err:
            raise InputError(shard, f"not a valid safetensors file: {err}") from None
        refuse_quantized(shard, header.metadata, [e.name for e in header.tensors])
        tensors |= {e.name: (e.shape, e.dtype) for e in header.tensors}
        files |= {e.name: shard for e in header.tensors}
    return Checkpoint(tensors, files)


def read_float_tensors(found: Detected) -> dict[str, torch.Tensor]:
    """FLOAT's tensors, read through the directory's descriptor by the format registry's
    reader (transformers gets them as a state dict: it never opens FLOAT's weight files)."""
    return read_tensors(found)[0]


def float_parts(
    found: Detected, config: dict[str, object], path: Path, role: Role
) -> tuple[Checkpoint, Any, hf.Tokenizer]:
    """The checkpoint's headers, transformers' config and the tokenizer of the float model
    `found` (from `float_source`): InputError when transformers' stale GGUF marker sits over
    weights that are not float, or config.json's counts are not the checkpoint's."""
    checkpoint = read_checkpoint(found)
    if isinstance(found.config, dict) and stale_config.is_gguf_marker(found.config):
        stale_config.check_float_weights(  # transformers' marker over float weights: float
            ((name, d) for name, (_, d) in checkpoint.tensors.items()), path / CONFIG
        )
    check_counts(config, path / CONFIG, checkpoint.shapes())
    hf_config = hf.config_from(config, path, role.who)
    tokenizer = hf.tokenizer(path, role.who, hf_config)  # before the weights: fails at once
    return checkpoint, hf_config, tokenizer


def empty_model(
    kind: str, config: dict[str, object], hf_config: Any, checkpoint: Checkpoint, path: Path
) -> Any:
    """The model `hf_config` describes (the class from_pretrained(path) would pick, AutoModel's
    for an encoder), built once on the meta device (no memory) and checked against the
    weights (check_sizes)."""
    transformers = hf.transformers_module()
    auto = transformers.AutoModelForCausalLM if kind == CAUSAL_LM else transformers.AutoModel
    try:
        cls = auto._model_mapping[type(hf_config)]
    except KeyError:
        raise InputError(
            path, f"transformers has no {auto.__name__} for model_type {config.get('model_type')!r}"
        ) from None
    return check_sizes(cls, hf_config, checkpoint, path)


def load_float(path: Path, dtype: torch.dtype) -> FloatModel:
    """FLOAT loaded by transformers in `dtype`, with its tokenizer; InputError when config.json
    asks for a model its weights do not hold (counts, then every parameter's shape, checked
    before anything is built for real) or it lacks a weight its architecture needs
    (transformers would initialise it at random)."""
    found, config = float_source(path, FLOAT)
    kind, architecture = kind_of(config)
    checkpoint, hf_config, tokenizer = float_parts(found, config, path, FLOAT)
    cls = type(empty_model(kind, config, hf_config, checkpoint, path))
    tensors = read_float_tensors(found)  # through qtool's reader, never by path again
    model, info = hf.from_pretrained(
        cls, path, "FLOAT", config=hf_config, state_dict=tensors, dtype=dtype
    )
    del tensors
    unexpected = frozenset(info.get("unexpected_keys") or ())  # e.g. a head AutoModel drops
    problem = loading_problem(info, unexpected)
    if problem:
        raise InputError(path, f"FLOAT {problem}")
    return FloatModel(path, architecture, kind, model.eval(), tokenizer, checkpoint, unexpected)


def float_shell(path: Path) -> FloatModel:
    """FLOAT without its weights: the model built on the meta device from its config.json
    (checked against its tensor headers as load_float checks them), its tokenizer and headers,
    for candidates to load into when the float side comes from a logits file."""
    found, config = float_source(path, FLOAT)
    kind, architecture = kind_of(config)
    checkpoint, hf_config, tokenizer = float_parts(found, config, path, FLOAT)
    built = empty_model(kind, config, hf_config, checkpoint, path)
    prefix = getattr(built, "base_model_prefix", "") or ""
    used = dict.fromkeys(built.state_dict())
    unexpected = frozenset(
        name for name in checkpoint.tensors if _stored_name(name, prefix, used) is None
    )  # what transformers' loading would report unexpected (a head AutoModel drops)
    return FloatModel(path, architecture, kind, built.eval(), tokenizer, checkpoint, unexpected)


def check_sizes(cls: Any, hf_config: Any, checkpoint: Checkpoint, path: Path) -> Any:
    """The model config.json describes, built on the meta device (no memory) and returned,
    checked against the weights: a parameter of another shape than its tensor, or more
    parameter values in all than the checkpoint holds (a vocabulary or hidden size the weights
    do not have), is InputError naming config.json, the tensor and its file, before
    transformers builds the model for real (it would allocate what config.json says, then
    report "look at the above report!")."""
    config_json = path / CONFIG
    try:
        with hf.quiet(), hf.guarded(), torch.device("meta"):
            built = cls(copy.deepcopy(hf_config))
    except Exception as err:  # a third-party constructor raises what it likes
        raise InputError(
            config_json, f"transformers cannot build the model it describes: {hf.first_line(err)}"
        ) from None
    problem = routing_problem(hf_config)
    if problem is not None:
        raise InputError(config_json, problem)
    held = checkpoint.tensors
    prefix = getattr(cls, "base_model_prefix", "") or ""
    unmatched = []
    for name, param in built.named_parameters():
        shape = tuple(param.shape)
        stored = _stored_name(name, prefix, held) or router_name(name, held)
        if stored is not None:
            _check_shape(stored, shape, checkpoint, config_json)
            continue
        stacked = stacked_experts(name, shape, held)  # MoE Linears stored apart
        if stacked is None:
            unmatched.append((name, shape))
        for parts in stacked or ():
            for part in parts:
                _check_shape(part, expert_linear_shape(shape, len(parts)), checkpoint, config_json)
    wanted = sum(p.numel() for p in built.parameters())
    values = sum(math.prod(shape) for shape, _ in held.values())
    if wanted > values:
        example = (
            f" ({unmatched[0][0]} {list(unmatched[0][1])} is in no weight file)"
            if unmatched
            else ""
        )
        raise InputError(
            config_json, f"describes a model of {wanted:,} parameters, but the weights hold "
            f"{values:,} values{example}; config.json does not describe these weights",
        )  # fmt: skip
    check_unused(built, prefix, checkpoint, config_json)
    check_buffers(built, values, config_json)
    return built


def _check_shape(
    stored: str, shape: tuple[int, ...], checkpoint: Checkpoint, config_json: Path
) -> None:
    """InputError naming tensor `stored` when the checkpoint holds it in another shape than
    the `shape` config.json makes it (an expert's Linear narrowed, transposed, 3-D, empty), or
    in an integer dtype (a float parameter's values: an I32 expert was cast silently)."""
    held, dtype = checkpoint.tensors[stored]
    if not dtype.startswith(("F", "BF")):
        where = checkpoint.files.get(stored, config_json)
        raise InputError(
            where, f"holds this weight as {dtype}, but the model's parameter is floating "
            "point; give the unquantized checkpoint", stored,
        )  # fmt: skip
    if held != shape:
        where = checkpoint.files.get(stored, config_json)
        raise InputError(
            config_json, f"config.json makes it {list(shape)}, but {where.name} holds "
            f"{list(held)}; config.json does not describe these weights "
            "(another model's config?)", stored,
        )  # fmt: skip


def check_unused(built: Any, prefix: str, checkpoint: Checkpoint, config_json: Path) -> None:
    """InputError naming config.json, the first checkpoint tensor the model `built` has no
    place for and how many there are: a layer count below the checkpoint's
    (`num_hidden_layers: 1` of 2 ran eval on one layer, 9 tensors silently unused). A head the
    base model AutoModel builds drops (BertForMaskedLM's `cls.*` beside `bert.*`) and the
    tensors the class itself ignores on load (`_keys_to_ignore_on_load_unexpected`) are
    allowed, and so are the buffers older checkpoints store that transformers now computes
    (BERT's `position_ids`, Llama's per-layer `rotary_emb.inv_freq`), which it ignores on load
    by the same rule (modeling_utils._adjust_missing_and_unexpected_keys)."""
    state = built.state_dict()
    used = set(state) | stored_apart(state, checkpoint.tensors)  # MoE experts stored apart
    ignored = [
        re.compile(p) for p in getattr(built, "_keys_to_ignore_on_load_unexpected", None) or ()
    ]
    buffers = [name for name, _ in built.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        ignored.append(re.compile(r"rotary_emb\.inv_freq"))
    if any(name.endswith("position_ids") for name in buffers):
        ignored.append(re.compile(r"(^|\.)position_ids$"))
    held = checkpoint.tensors
    base = prefix and built.base_model is built and any(n.startswith(f"{prefix}.") for n in held)
    unused = [
        name
        for name in held
        if _stored_name(name, prefix, dict.fromkeys(used)) is None
        and not any(p.search(name) for p in ignored)
        and not (base and not name.startswith(f"{prefix}."))  # a head the base model drops
    ]
    if unused:
        where = checkpoint.files.get(unused[0], config_json).name
        raise InputError(
            config_json, f"describes a model with no place for this tensor of {where} "
            f"({len(unused):,} of the checkpoint's tensors in all); config.json does not "
            "describe these weights (a layer or expert count below the checkpoint's?), and "
            "qtool never drops weights", unused[0],
        )  # fmt: skip


MIN_BUFFER_BYTES = 64 << 20
"""Buffers (computed, not stored: a sinusoidal position table, rotary frequencies, a causal
mask) may take at most 4 bytes per checkpoint value, or this much: config.json sizes them
(`max_position_embeddings` times the hidden size), and no checkpoint backs them."""


def check_buffers(built: Any, values: int, config_json: Path) -> None:
    """InputError naming config.json and the largest buffer when the model `built` on the meta
    device holds more buffer bytes than MIN_BUFFER_BYTES or 4 per checkpoint value (`values`):
    XGLM's position table of 40,000,000 positions took 50 s and 7.9 GB before failing."""
    buffers = [(n, b) for n, b in built.named_buffers() if b is not None]
    total = sum(b.numel() * b.element_size() for _, b in buffers)
    bound = max(MIN_BUFFER_BYTES, 4 * values)
    if total > bound:
        name, largest = max(buffers, key=lambda nb: nb[1].numel() * nb[1].element_size())
        raise InputError(
            config_json, f"describes a model whose computed buffers take {total:,} bytes "
            f"(the largest: {name} {list(largest.shape)}), more than the {bound:,} its "
            f"{values:,} weight values allow; check max_position_embeddings and the sizes in "
            "config.json",
        )  # fmt: skip


def _stored_name(name: str, prefix: str, held: dict[str, Any]) -> str | None:
    """The checkpoint's name of the model parameter `name`: the same, or with or without the
    base model's prefix (a BertModel's `embeddings...` is `bert.embeddings...` in a checkpoint
    saved from BertForMaskedLM)."""
    candidates = [name]
    if prefix:
        candidates += [f"{prefix}.{name}", name.removeprefix(f"{prefix}.")]
    return next((c for c in candidates if c in held), None)


def loading_problem(info: dict[str, Any], unexpected_ok: frozenset[str]) -> str | None:
    """What transformers' loading info says went wrong, or None: weights the architecture needs
    but the checkpoint lacks, tensors of another shape, tensors nothing uses."""
    for key, what in (
        ("missing_keys", "lacks weights its architecture needs"),
        ("mismatched_keys", "has weights of another shape than its architecture's"),
    ):
        names = sorted(str(n if isinstance(n, str) else n[0]) for n in info.get(key) or ())
        if names:
            return f"{what}: {listed(names)}"
    extra = sorted(set(info.get("unexpected_keys") or ()) - unexpected_ok)
    if extra:
        return f"holds tensors the architecture does not use: {listed(extra)}"
    return None


def listed(names: list[str], limit: int = 3) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
