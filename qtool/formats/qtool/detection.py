"""What the qtool format's detectors recognise (a sidecar, a quantized file, a directory of
quantized files), the reader of what they found, and what `inspect` shows; imported on first
use (the package's __init__ registers these without importing them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qtool.errors import UsageError
from qtool.formats.base import FloatReader
from qtool.formats.detect import Detected, HeaderView, Probe
from qtool.formats.qtool import INDEX_SECTION, NAME, SIDECAR_SUFFIX
from qtool.formats.qtool import config as model_config
from qtool.formats.qtool.manifest import MANIFEST_KEY, is_quantized, sidecar_path
from qtool.io.jsonfile import read_json
from qtool.results import InspectSummary


def sidecar(probe: Probe) -> Detected | None:
    header = probe.header
    if header is None or MANIFEST_KEY not in (header.metadata or {}):
        return None
    return probe.as_file("qtool-sidecar", NAME, "a qtool qparams sidecar", quantized=True)


def quantized_file(probe: Probe) -> Detected | None:
    header = probe.header
    if header is None or not is_quantized(header.metadata):
        return None
    return probe.as_file("qtool-file", NAME, "a qtool-quantized file", quantized=True)


def directory(probe: Probe) -> Detected | None:
    """A sharded output (its index has a `qtool` section, or its first shard is quantized), or
    a model directory holding one quantized file (beside its sidecar)."""
    if not probe.checkpoint_dir:
        return None
    what = "a directory of qtool-quantized files"
    sharded = probe.sharded
    if sharded is not None:
        first = sharded.shards[0]
        if INDEX_SECTION in sharded.raw or _quantized(probe, first):
            return _unmarked(probe.as_directory("qtool-sharded", NAME, what, quantized=True))
        return None
    weights = [n for n in probe.safetensors_files() if not n.endswith(SIDECAR_SUFFIX)]
    if len(weights) != 1 or not _quantized(probe, weights[0]):
        return None
    found = probe.as_directory("qtool-directory", NAME, what, quantized=True, weights=weights)
    return _unmarked(found)


def _unmarked(found: Detected) -> Detected:
    """The directory with the model's own config.json (what its marked one records)."""
    return dataclasses.replace(found, config=model_config.unmarked(found.config))


def _quantized(probe: Probe, name: str) -> bool:
    header = probe.header_of(name)
    return header is not None and is_quantized(header.metadata)


def header(view: HeaderView) -> str | None:
    if MANIFEST_KEY in view.metadata:
        return "a qtool qparams sidecar"
    return "a qtool-quantized file" if is_quantized(view.metadata) else None


def reader(found: Detected, qparams: Path | None) -> FloatReader:
    from qtool.formats.dense.reader import ShardedReader
    from qtool.formats.qtool.reader import QtoolReader

    if found.directory is None:
        return QtoolReader(found.path, qparams)
    if qparams is not None:
        raise UsageError(
            qparams,
            "a checkpoint directory has one sidecar per shard, found beside each shard; give no "
            "sidecar",
            hint="qparams",
        )
    restored = {}
    if found.config_path is not None and found.within is not None:
        on_disk = found.within.exists(found.config_path.name) and read_json(
            found.config_path, within=found.within, what="config.json"
        )
        if model_config.is_marked(on_disk):  # the model's own config, unmarked (config.py)
            restored["config.json"] = model_config.config_bytes(found.config)
    return ShardedReader(found, lambda w: QtoolReader(w, None, found.within), restored)


def inspect(found: Detected) -> InspectSummary:
    from qtool.formats.qtool import inspect

    return inspect.inspect(found)


def belongings(path: Path) -> list[Path]:
    return [sidecar_path(path)]
