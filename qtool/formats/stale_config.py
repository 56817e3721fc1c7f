"""A config.json `quantization_config` that does not describe the weights beside it (torch-free).

transformers sets `{"quant_method": "gguf", "gguf_file": ..., "dequantize": ...}` on a model it
loads from a GGUF file (`from_pretrained(dir, gguf_file=...)`); saving that model's config (and
its weights, which are float: transformers unpacks the GGUF blocks) leaves the key in config.json
over plain float tensors. Such a directory is a float model: the weights say so, and qtool drops
the stale key from what it writes. Any other quantization_config stays refused."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from qtool.errors import InputError

KEY = "quantization_config"
GGUF_METHOD = "gguf"
PLAIN_FLOATS = frozenset({"F64", "F32", "F16", "BF16"})
"""The dtypes of unquantized weights (F8 types are quantized weights)."""

REMOVE = f'delete the "{KEY}" key from config.json'


def method_of(config: Mapping[str, object]) -> str | None:
    """The quant_method config.json's quantization_config names (None: none, or no name)."""
    q = config.get(KEY)
    method = q.get("quant_method") if isinstance(q, Mapping) else None
    return method if isinstance(method, str) else None


def is_gguf_marker(config: Mapping[str, object]) -> bool:
    """config.json's quantization_config is the one transformers sets on a model loaded from a
    GGUF file, which describes that file, not the weights saved beside this config."""
    return isinstance(config.get(KEY), Mapping) and method_of(config) == GGUF_METHOD


def refusal(config: Mapping[str, object], path: Path | None) -> InputError:
    """The error for an input whose config.json has a quantization_config qtool cannot ignore:
    names the key, its quant_method, and how to remove it when the weights are float."""
    method = method_of(config)
    what = f' (quant_method "{method}")' if method else ""
    return InputError(
        path,
        f"already quantized: config.json has a {KEY}{what}; quantize the original float "
        f"checkpoint instead (if these weights are float, {REMOVE})",
    )


def check_float_weights(dtypes: Iterable[tuple[str, str]], path: Path | None) -> None:
    """InputError unless every (name, safetensors dtype) is a plain float: a GGUF marker is
    only stale over float weights."""
    for name, dtype in dtypes:
        if dtype not in PLAIN_FLOATS:
            raise InputError(
                path,
                f'config.json has transformers\' GGUF marker ({KEY} quant_method "gguf") but '
                f"{name} is {dtype}, not float, so these are not the float weights it leaves "
                f"behind; quantize the original float checkpoint (if it is float, {REMOVE})",
            )


def dropped_note(path: Path | None) -> str:
    """What qtool says when it drops a stale GGUF marker from what it writes."""
    where = f"{path}: " if path is not None else ""
    return (
        f'{where}dropped {KEY} {{"quant_method": "gguf"}} (transformers\' marker for a model '
        "loaded from a GGUF file; the weights here are float), so the output's config.json "
        "describes its own weights"
    )
