"""On-disk quantized formats, each behind one small protocol (formats/base.py): a registry of
output formats by name, and `open_reader`, which detects what a file is and reads it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qtool.spec import FormatName

if TYPE_CHECKING:
    from qtool.formats.base import FloatReader, FormatContext, OutputFormat


FORMAT_NAMES = tuple(f.value for f in FormatName)


def output_format(name: FormatName | str, context: FormatContext | None = None) -> OutputFormat:
    """The output format registered under `name`, set up for this run's `context` (ValueError
    for an unknown name; InputError when the context does not fit the format)."""
    if name == FormatName.QTOOL:  # each imported only when used: qtool's is torch-free
        from qtool.formats.qtool_writer import QtoolFormat

        return QtoolFormat()
    if name == FormatName.COMPRESSED_TENSORS:
        from qtool.formats.base import FormatContext
        from qtool.formats.ct_writer import CompressedTensorsFormat

        return CompressedTensorsFormat(context or FormatContext())
    raise ValueError(f"unknown format {name!r}; choose one of {', '.join(FORMAT_NAMES)}")


def open_reader(path: Path, qparams: Path | None = None) -> FloatReader:
    """Any checkpoint as float tensors: a qtool-quantized file (with its sidecar, or `qparams`)
    and a compressed-tensors model directory are dequantized on the fly; a plain checkpoint
    (or model directory) is read as it is."""
    from qtool.formats.ct_read import is_model_directory
    from qtool.formats.ct_reader import ModelReader
    from qtool.formats.dense import DenseReader
    from qtool.formats.qtool import is_quantized
    from qtool.formats.qtool_reader import QtoolReader
    from qtool.io.checkpoint import open_checkpoint

    if qparams is not None:
        return QtoolReader(path, qparams)
    if is_model_directory(path):
        return ModelReader(path)
    probe = open_checkpoint(path)
    if not is_quantized(probe.metadata):
        return DenseReader(path, probe)
    probe.close()
    return QtoolReader(path)
