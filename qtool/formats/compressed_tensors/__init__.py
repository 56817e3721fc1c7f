"""compressed-tensors `pack-quantized`: Hugging Face model directories transformers and vLLM load.

  coerce.py     a quantization_config read exactly as compressed-tensors' pydantic models do
  config.py     the quantization_config: parsed when read, built for an export
  schemes.py    which config group applies to each quantized module (scheme resolution)
  modules.py    which nn.Linear modules the model has (transformers on the meta device, or rules)
  selection.py  which tensors an export quantizes (Linear weights), fused sets
  groups.py     group sizes that must divide K, and the group fallback
  loaders.py    what transformers and vLLM will do with it: warnings, load-time dequantization
  codec.py      one Linear weight encoded as packed codes and scales, and decoded back
  detection.py  what its detectors recognise (registered lazily by this module)
  reader.py     a model directory as float tensors;  writer.py  the export
  inspect.py    what `qtool inspect` shows

Registered as FormatName.COMPRESSED_TENSORS with two detectors (detect.PRIORITY has the
order): a model directory, or its index or config.json, whose config.json holds a
compressed-tensors quantization_config; and a lone shard holding its tensors (refused: read
through its directory). Torch-free at import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qtool.errors import InputError
from qtool.formats import detect, registry
from qtool.spec import Codec, FormatName, as_grid

if TYPE_CHECKING:
    from qtool.formats.base import FloatReader, FormatContext, OutputFormat
    from qtool.formats.detect import Detected
    from qtool.results import InspectSummary

NAME = FormatName.COMPRESSED_TENSORS.value
_FOUND = "qtool.formats.compressed_tensors.detection"


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
    from qtool.formats import listing
    from qtool.formats.compressed_tensors.inspect import inspect

    if found.directory is None:
        return listing.checkpoint_file(found.path)

    return inspect(found)


detect.register("compressed-tensors", registry.lazy(_FOUND, "model_directory"))
detect.register("compressed-tensors-file", registry.lazy(_FOUND, "shard_file"))
detect.register_header(registry.lazy(_FOUND, "header"))


def _refuses(spec: Codec) -> str | None:
    from qtool.formats.compressed_tensors.selection import check_spec

    try:
        check_spec(as_grid(spec))  # the registry asks only of the codecs it stores
    except ValueError as err:
        return str(err)
    return None


registry.register(
    registry.FormatEntry(
        NAME, _reader, _inspect, _output, refuses=_refuses, reads_config=True,
        transformers_loads=True,
        help="a model directory (pack-quantized, int8/int4) that transformers and vLLM load; "
        "needs -o DIR.",
    )
)  # fmt: skip
