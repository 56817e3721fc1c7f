"""What the compressed-tensors detectors recognise (a model directory whose config.json says
so, a lone shard holding its tensors, a checkpoint file's tensor names); imported on first use
(the package's __init__ registers these without importing them)."""

from __future__ import annotations

from qtool.errors import InputError
from qtool.formats.compressed_tensors import NAME
from qtool.formats.compressed_tensors.config import quantization_config_of
from qtool.formats.detect import SAFETENSORS, Detected, HeaderView, Probe
from qtool.io.index import INDEX_SUFFIX


def model_directory(probe: Probe) -> Detected | None:
    """A directory (or its index or config.json) whose config.json says compressed-tensors;
    its weights: the index's shards, else its one *.safetensors file."""
    if probe.directory is None or quantization_config_of(probe.config) is None:
        return None
    what = "a compressed-tensors model directory"
    if probe.index_name is not None:
        return probe.as_directory("compressed-tensors", NAME, what, quantized=True)
    files = [n for n in probe.within.names() if n.endswith(SAFETENSORS)] if probe.within else []
    if len(files) != 1:
        raise InputError(
            probe.directory,
            f"a compressed-tensors model directory holds one *{SAFETENSORS} file or an "
            f"*{INDEX_SUFFIX} index; found {len(files)} and no index",
        )
    return probe.as_directory("compressed-tensors", NAME, what, quantized=True, weights=files)


_STORED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_zero_point")


def header(view: HeaderView) -> str | None:
    """A file holding pack-quantized codes or naive-quantized scales (by its tensor names)."""
    if any(n.endswith(_STORED_SUFFIXES) for n in view.names):
        return "a compressed-tensors checkpoint (it holds *.weight_packed / *.weight_scale)"
    return None


def shard_file(probe: Probe) -> Detected | None:
    """A lone file holding compressed-tensors tensors: a shard taken out of its model directory
    (read only through that directory, which holds the config that says how to decode it)."""
    head = probe.header
    if head is None:
        return None
    what = header(HeaderView(probe.path, head.metadata or {}, [e.name for e in head.tensors]))
    if what is None:
        return None
    return probe.as_file("compressed-tensors-file", NAME, what, quantized=True)
