"""Recognising checkpoints that are already quantized, so that they are never quantized again
(torch-free: headers only).

Quantizing codes would store codes of codes: the int8 tensors would pass through as "integer
tensors", a new, empty sidecar would replace the link to the real one, and dequantize would
then "restore" raw codes as floats. Each detector looks at what a header shows (metadata,
tensor names, the file's place on disk) and names the format it recognises. A new quantized
format adds one detector to DETECTORS; compressed-tensors: a `config.json` beside the file with
a compressed-tensors `quantization_config`, or tensors named `*.weight_packed` / `*.weight_scale`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from qtool.errors import InputError
from qtool.formats.ct_read import is_compressed_tensors
from qtool.formats.qtool import MANIFEST_KEY, is_quantized


@dataclass(frozen=True)
class HeaderView:
    """What a detector may look at: a checkpoint file's path, metadata and tensor names."""

    path: Path
    metadata: dict[str, str]
    names: Sequence[str]


Detector = Callable[[HeaderView], str | None]


def _qtool_quantized(view: HeaderView) -> str | None:
    return "a qtool-quantized file" if is_quantized(view.metadata) else None


def _qtool_sidecar(view: HeaderView) -> str | None:
    return "a qtool qparams sidecar" if MANIFEST_KEY in view.metadata else None


_CT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_zero_point")


def _compressed_tensors(view: HeaderView) -> str | None:
    """Its tensor names (pack-quantized codes, or naive-quantized scales), or the config.json
    beside it (a shard of a compressed-tensors model directory)."""
    if any(n.endswith(_CT_SUFFIXES) for n in view.names):
        return "a compressed-tensors checkpoint (it holds *.weight_packed / *.weight_scale)"
    if is_compressed_tensors(view.path.parent):
        return "a shard of a compressed-tensors model (its config.json has a quantization_config)"
    return None


DETECTORS: tuple[Detector, ...] = (_qtool_sidecar, _qtool_quantized, _compressed_tensors)


def quantized_format(view: HeaderView) -> str | None:
    """The quantized format the file is in, or None for a plain (float) checkpoint."""
    return next((found for d in DETECTORS if (found := d(view)) is not None), None)


def refuse_quantized(path: Path, metadata: dict[str, str] | None, names: Sequence[str]) -> None:
    """InputError when `path` is already quantized (or is a sidecar)."""
    found = quantized_format(HeaderView(path, metadata or {}, names))
    if found is not None:
        raise InputError(
            path,
            f"is {found}, not a float checkpoint: it holds already quantized data, and "
            "quantizing it again would store codes of codes; quantize the original float "
            "checkpoint (qtool dequantize makes a float copy if the original is lost)",
        )
