"""FLOAT as `detect` finds it (torch-free): a model directory with its config.json (read once,
through the directory's descriptor, like every config), not an already quantized one, and which
kind of model it is."""

from __future__ import annotations

from pathlib import Path

from qtool.errors import InputError
from qtool.eval_results import CAUSAL_LM, ENCODER
from qtool.formats import stale_config
from qtool.formats.detect import CONFIG, Detected, detect

CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
FLOAT_WANTED = (
    "FLOAT must be a Hugging Face model directory (config.json beside safetensors weights)"
)


def float_source(path: Path) -> tuple[Detected, dict[str, object]]:
    """FLOAT detected, and its config.json (InputError when `path` is not a float model
    directory: a file, a directory without config.json, or a quantized model)."""
    if not path.exists():
        raise InputError(path, "no such file or directory; check the path")
    if not path.is_dir():
        raise InputError(path, f"{FLOAT_WANTED}; this is a file")
    found = detect(path)
    config = found.config
    if config is None:
        raise InputError(path, f"{FLOAT_WANTED}; it has no {CONFIG}")
    if not isinstance(config, dict):
        raise InputError(path / CONFIG, f"not a valid {CONFIG}: expected a JSON object")
    stale = stale_config.is_gguf_marker(config)  # the weights decide (models.load_float)
    if found.quantized:
        raise InputError(
            path, f"FLOAT is already quantized ({found.description}); give the float model as "
            "FLOAT and the quantized one as QUANT",
        )  # fmt: skip
    if stale_config.KEY in config and not stale:
        raise InputError(
            path, f"FLOAT is already quantized (its config.json has a {stale_config.KEY}"
            f"{_method(config)}); give the float model as FLOAT and the quantized one as QUANT "
            f"(if its weights are float, {stale_config.REMOVE})",
        )  # fmt: skip
    return found, {k: v for k, v in config.items() if k != stale_config.KEY}


def _method(config: dict[str, object]) -> str:
    method = stale_config.method_of(config)
    return f' with quant_method "{method}"' if method else ""


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
