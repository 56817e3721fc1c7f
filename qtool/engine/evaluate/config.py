"""FLOAT's config.json, read like every config (torch-free): whether it is a model directory
at all, not an already quantized one, and which kind of model it is."""

from __future__ import annotations

from pathlib import Path

from qtool.errors import InputError
from qtool.eval_results import CAUSAL_LM, ENCODER
from qtool.io.jsonfile import read_json_object
from qtool.io.safeopen import InputDir

CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def read_config(path: Path) -> dict[str, object]:
    """FLOAT's config.json (InputError when `path` is not a model directory, or a quantized one)."""
    if not path.is_dir():
        raise InputError(
            path, "FLOAT must be a model directory (config.json and safetensors weights)"
        )
    config = read_json_object(path / "config.json", within=InputDir(path), what="config.json")
    if "quantization_config" in config:
        raise InputError(
            path, "FLOAT is already quantized (its config.json has a quantization_config); "
            "give the float model as FLOAT and the quantized one as QUANT",
        )  # fmt: skip
    return config


def kind_of(config: dict[str, object]) -> tuple[str, str]:
    """(kind, architecture): a causal LM when an architecture's name ends in ForCausalLM or
    LMHeadModel (LlamaForCausalLM, GPT2LMHeadModel), an encoder otherwise (BertModel)."""
    names = config.get("architectures")
    archs = [a for a in names if isinstance(a, str)] if isinstance(names, list) else []
    causal = [a for a in archs if a.endswith(CAUSAL_SUFFIXES)]
    if causal:
        return CAUSAL_LM, causal[0]
    model_type = config.get("model_type")
    return ENCODER, archs[0] if archs else str(model_type or "unknown")
