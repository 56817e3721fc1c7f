"""Plain float checkpoints (reader.py; writer.py writes what `qtool dequantize` gives back).

Registered as "dense" (read only: `--format` never writes it) with the detectors of plain
checkpoints (detect.PRIORITY has the order): a sharded checkpoint (an index, or a directory
holding one), a model directory with one *.safetensors file and no index, and any other file
(a .safetensors, .pt, .pth or .bin file; its reader says what is wrong with anything else).
Torch-free at import.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.formats import detect, registry

if TYPE_CHECKING:
    from qtool.formats.base import FloatReader
    from qtool.formats.detect import Detected, Probe
    from qtool.io.atomic import OutputSet
    from qtool.results import DequantizedRow, InspectSummary

NAME = "dense"


def _sharded(probe: Probe) -> Detected | None:
    if not probe.checkpoint_dir or probe.sharded is None:
        return None
    return probe.as_directory("sharded", NAME, "a sharded checkpoint", quantized=False)


def _model_directory(probe: Probe) -> Detected | None:
    if not probe.is_dir or probe.index_name is not None:
        return None
    files = probe.safetensors_files()
    if len(files) != 1:
        return None
    return probe.as_directory(
        "model-directory", NAME, "a model directory", quantized=False, weights=files
    )


def _file(probe: Probe) -> Detected | None:
    if probe.is_dir:
        return None
    return probe.as_file("checkpoint", NAME, "a plain checkpoint", quantized=False)


def _reader(found: Detected, qparams: Path | None) -> FloatReader:
    """`qparams` is the qtool format's (registry.open_reader never passes one here)."""
    from qtool.formats.dense.reader import DenseReader, ShardedReader
    from qtool.io.checkpoint import open_checkpoint

    if found.directory is None:
        return DenseReader(found.path)
    return ShardedReader(found, lambda w: DenseReader(w, open_checkpoint(w, found.within)))


def _write(
    reader: FloatReader, out: Path, outputs: OutputSet, dtype: str, names: Sequence[str]
) -> list[DequantizedRow]:
    from qtool.formats.dense.writer import write_dense

    return write_dense(reader, out, outputs, dtype, names)


def _inspect(found: Detected) -> InspectSummary:
    from qtool.formats import listing

    if found.directory is None:
        return listing.checkpoint_file(found.path)
    return listing.directory(found, listing.checkpoint_file, "checkpoint", "sharded")


detect.register("sharded", _sharded)
detect.register("model-directory", _model_directory)
detect.register("checkpoint", _file)
registry.register(registry.FormatEntry(NAME, _reader, _inspect))
registry.register_float_writer(_write)
