"""FLOAT, the reference model: a Hugging Face model directory checked by qtool (found by
`detect`; config.json and the safetensors headers read through the directory's descriptor,
strictly, and refused when already quantized) and then loaded by transformers, once, in the
compute dtype."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qtool.engine.evaluate import hf
from qtool.engine.evaluate.config import float_source, kind_of
from qtool.engine.evaluate.readers import read_tensors
from qtool.engine.source import Source
from qtool.errors import InputError
from qtool.eval_results import CAUSAL_LM
from qtool.formats.detect import Detected, refuse_quantized
from qtool.io.stformat import HeaderError


@dataclass(frozen=True)
class Checkpoint:
    """The tensors a checkpoint holds: name -> (shape, safetensors dtype)."""

    tensors: dict[str, tuple[tuple[int, ...], str]]


@dataclass(frozen=True)
class FloatModel:
    path: Path
    architecture: str
    kind: str  # CAUSAL_LM or ENCODER
    model: Any  # a transformers PreTrainedModel, in eval mode, in the compute dtype
    tokenizer: Any
    checkpoint: Checkpoint
    unexpected: frozenset[str]  # checkpoint tensors the architecture does not use (a head)


def read_checkpoint(found: Detected) -> Checkpoint:
    """The tensors of a model directory's safetensors (headers only, read through the
    directory's descriptor; a quantized one refused)."""
    source = Source(found)
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for shard in source.shards:
        try:
            header = source.header(shard)
        except HeaderError as err:
            raise InputError(shard, f"not a valid safetensors file: {err}") from None
        refuse_quantized(shard, header.metadata, [e.name for e in header.tensors])
        tensors |= {e.name: (e.shape, e.dtype) for e in header.tensors}
    return Checkpoint(tensors)


def read_float_tensors(found: Detected) -> dict[str, torch.Tensor]:
    """FLOAT's tensors, read through the directory's descriptor by the format registry's
    reader (transformers gets them as a state dict: it never opens FLOAT's weight files)."""
    return read_tensors(found)[0]


def load_float(path: Path, dtype: torch.dtype) -> FloatModel:
    """FLOAT loaded by transformers in `dtype`, with its tokenizer; InputError when it lacks a
    weight its architecture needs (transformers would initialise it at random)."""
    found, config = float_source(path)
    kind, architecture = kind_of(config)
    checkpoint = read_checkpoint(found)
    tokenizer = hf.tokenizer(path, "FLOAT")  # before the weights: a missing one fails at once
    transformers = hf.transformers_module()
    auto = transformers.AutoModelForCausalLM if kind == CAUSAL_LM else transformers.AutoModel
    hf_config = hf.config_from(config, path, "FLOAT")
    try:
        cls = auto._model_mapping[type(hf_config)]  # the class from_pretrained(path) would pick
    except KeyError:
        raise InputError(
            path, f"transformers has no {auto.__name__} for model_type {config.get('model_type')!r}"
        ) from None
    tensors = read_float_tensors(found)  # through qtool's reader, never by path again
    model, info = hf.from_pretrained(
        cls, None, "FLOAT", config=hf_config, state_dict=tensors, dtype=dtype
    )
    del tensors
    unexpected = frozenset(info.get("unexpected_keys") or ())  # e.g. a head AutoModel drops
    problem = loading_problem(info, unexpected)
    if problem:
        raise InputError(path, f"FLOAT {problem}")
    return FloatModel(path, architecture, kind, model.eval(), tokenizer, checkpoint, unexpected)


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
