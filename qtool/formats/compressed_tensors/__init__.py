"""compressed-tensors `pack-quantized`: Hugging Face model directories transformers and vLLM load.

  coerce.py     a quantization_config read exactly as compressed-tensors' pydantic models do
  config.py     the quantization_config: parsed when read, built for an export
  schemes.py    which config group applies to each quantized module (scheme resolution)
  modules.py    which nn.Linear modules the model has (transformers on the meta device, or rules)
  selection.py  which tensors an export quantizes (Linear weights), fused sets
  groups.py     group sizes that must divide K, and the group fallback
  loaders.py    what transformers and vLLM will do with it: warnings, load-time dequantization
  codec.py      one Linear weight encoded as packed codes and scales, and decoded back
  reader.py     a model directory as float tensors;  writer.py  the export
  inspect.py    what `qtool inspect` shows

Registered as FormatName.COMPRESSED_TENSORS with two detectors (detect.PRIORITY has the
order): a model directory, or its index or config.json, whose config.json holds a
compressed-tensors quantization_config; and a lone shard holding its tensors (refused: read
through its directory). Torch-free at import.
"""

from __future__ import annotations

from pathlib import Path

from qtool.errors import InputError
from qtool.formats import detect, listing, registry
from qtool.formats.base import FloatReader, FormatContext, OutputFormat
from qtool.formats.compressed_tensors.config import quantization_config_of
from qtool.formats.compressed_tensors.selection import FORMAT, check_spec
from qtool.formats.detect import SAFETENSORS, Detected, HeaderView, Probe
from qtool.io.index import INDEX_SUFFIX
from qtool.results import InspectSummary
from qtool.spec import QSpec

NAME = FORMAT


def _model_directory(probe: Probe) -> Detected | None:
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


def _header(view: HeaderView) -> str | None:
    """A file holding pack-quantized codes or naive-quantized scales (by its tensor names)."""
    if any(n.endswith(_STORED_SUFFIXES) for n in view.names):
        return "a compressed-tensors checkpoint (it holds *.weight_packed / *.weight_scale)"
    return None


def _shard_file(probe: Probe) -> Detected | None:
    """A lone file holding compressed-tensors tensors: a shard taken out of its model directory
    (read only through that directory, which holds the config that says how to decode it)."""
    header = probe.header
    if header is None:
        return None
    what = _header(HeaderView(probe.path, header.metadata or {}, [e.name for e in header.tensors]))
    if what is None:
        return None
    return probe.as_file("compressed-tensors-file", NAME, what, quantized=True)


def _output(context: FormatContext) -> OutputFormat:
    from qtool.formats.compressed_tensors.writer import CompressedTensorsFormat

    return CompressedTensorsFormat(context)


def _reader(found: Detected, qparams: Path | None) -> FloatReader:
    from qtool.formats.compressed_tensors.reader import ModelReader

    if found.directory is None:
        raise InputError(
            found.path,
            f"is {found.description}; pass its model directory ({found.path.parent}) instead",
        )

    return ModelReader(found)


def _inspect(found: Detected) -> InspectSummary:
    from qtool.formats.compressed_tensors.inspect import inspect

    if found.directory is None:
        return listing.checkpoint_file(found.path)

    return inspect(found)


detect.register("compressed-tensors", _model_directory)
detect.register("compressed-tensors-file", _shard_file)
detect.register_header(_header)


def _refuses(spec: QSpec) -> str | None:
    try:
        check_spec(spec)
    except ValueError as err:
        return str(err)
    return None


registry.register(
    registry.FormatEntry(
        NAME, _reader, _inspect, _output, refuses=_refuses, reads_config=True,
        help="a model directory (pack-quantized, int8/int4) that transformers and vLLM load; "
        "needs -o DIR.",
    )
)  # fmt: skip
