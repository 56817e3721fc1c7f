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
    summary = registry.inspect(detect(path))
    return replace(summary, rows=sorted(summary.rows, key=lambda r: natural_key(r.name)))
