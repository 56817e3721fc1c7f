"""`qtool inspect`: what is inside any checkpoint `detect` recognises, as its format lists it
(torch-free for safetensors; a torch pickle has to be loaded, safely, to be listed)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from qtool.formats import registry
from qtool.formats.detect import detect
from qtool.results import InspectSummary, natural_key


def inspect_path(path: Path) -> InspectSummary:
    """Describe what `path` holds (a checkpoint, a quantized file, a sidecar, a directory), its
    tensors in natural name order (`layers.2` before `layers.10`), not in the byte layout's
    order, which groups them by dtype."""
    found = detect(path)
    summary = registry.inspect(found)
    if found.kind == "gguf":  # an imatrix GGUF: calibrate --sensitivity's keys, if it holds them
        sensitivities = _sensitivities(found.path)
        if sensitivities is not None:
            summary = replace(summary, metadata={**(summary.metadata or {}),
                                                 SENSITIVITIES: sensitivities})  # fmt: skip
    return replace(summary, rows=sorted(summary.rows, key=lambda r: natural_key(r.name)))


SENSITIVITIES = "qtool.sensitivity"


def _sensitivities(path: Path) -> str | None:
    """What the file's qtool.sensitivity.* keys say; their reader (and torch, which the joint
    fit's numerics import) is loaded only for a file that has them."""
    from qtool.io.gguf_file import GGUFFile

    with GGUFFile(path) as f:
        metadata = f.header.metadata
    if not any(key.startswith(SENSITIVITIES + ".") for key in metadata):
        return None
    from qtool.formats.imatrix.sensitivity import describe

    return describe(metadata)
