"""A float model as `detect` finds it (torch-free), for eval's FLOAT and calibrate's MODEL alike:
a model directory with its config.json (read once, through the directory's descriptor, like
every config), not an already quantized one, which kind of model it is, and the window its
max_position_embeddings allows. Each command names its model in messages through a `Role`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qtool.errors import InputError, UsageError
from qtool.eval_results import CAUSAL_LM, ENCODER
from qtool.formats import stale_config
from qtool.formats.detect import CONFIG, Detected, detect

CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
DEFAULT_CTX = 512


@dataclass(frozen=True)
class Role:
    """How a command names its float model in messages: `arg`, its argument (FLOAT, MODEL);
    `who` in sentences ("FLOAT", "the model"); `refusal`, the error for a quantized one (by
    its weights, or by a quantization_config that is not transformers' stale GGUF marker)."""

    arg: str
    who: str
    refusal: Callable[[Path, Detected, dict[str, object]], InputError]


def _float_refusal(path: Path, found: Detected, config: dict[str, object]) -> InputError:
    if found.quantized:
        return InputError(
            path, f"FLOAT is already quantized ({found.description}); give the float model as "
            "FLOAT and the quantized one as QUANT",
        )  # fmt: skip
    return InputError(
        path, f"FLOAT is already quantized (its config.json has a {stale_config.KEY}"
        f"{_method(config)}); give the float model as FLOAT and the quantized one as QUANT "
        f"(if its weights are float, {stale_config.REMOVE})",
    )  # fmt: skip


FLOAT = Role("FLOAT", "FLOAT", _float_refusal)


def float_source(path: Path, role: Role = FLOAT) -> tuple[Detected, dict[str, object]]:
    """The model directory `path` detected, and its config.json (InputError when it is not a
    float model directory: a file, a directory without config.json, or a quantized model)."""
    wanted = (
        f"{role.arg} must be a Hugging Face model directory ({CONFIG} beside safetensors weights)"
    )
    if not path.exists():
        raise InputError(path, "no such file or directory; check the path")
    if not path.is_dir():
        raise InputError(path, f"{wanted}; this is a file")
    found = detect(path)
    config = found.config
    if config is None:
        raise InputError(path, f"{wanted}; it has no {CONFIG}")
    if not isinstance(config, dict):
        raise InputError(path / CONFIG, f"not a valid {CONFIG}: expected a JSON object")
    stale = stale_config.is_gguf_marker(config)  # the weights decide (models.float_parts)
    if found.quantized or (stale_config.KEY in config and not stale):
        raise role.refusal(path, found, config)
    return found, {k: v for k, v in config.items() if k != stale_config.KEY}


def _method(config: dict[str, object]) -> str:
    method = stale_config.method_of(config)
    return f' with quant_method "{method}"' if method else ""


def window_length(asked: int | None, hf_config: Any, path: Path, role: Role, shortest: int) -> int:
    """The window (causal) or sentence cut-off (encoder): `asked`, else DEFAULT_CTX, never more
    than the model's max_position_embeddings (UsageError when `asked` is). A limit below
    `shortest`, the command's shortest window (eval 2: one prediction; calibrate 1), is no
    limit it could honour, and is passed over."""
    limit: Any = getattr(hf_config, "max_position_embeddings", None)
    longest = limit if isinstance(limit, int) and limit >= shortest else None
    if asked is None:
        return min(DEFAULT_CTX, longest) if longest else DEFAULT_CTX
    if longest is not None and asked > longest:
        raise UsageError(
            path, f"a window of {asked} tokens is longer than {role.who}'s "
            f"max_position_embeddings ({longest}); choose at most {longest}",
        )  # fmt: skip
    return asked


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
