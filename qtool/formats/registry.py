"""Formats by name: each format package registers itself on import (as compressed-tensors'
compressors and gguf-py's quant types do), and the engine reaches every format through here:
`output_format` for `--format NAME`, `open_reader` and `inspect` for whatever `detect` found.

A format is a FormatEntry: its name (spec.FormatName for the formats `--format` writes) and
what it can do, each imported only when used, so that `inspect` and dry runs stay torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.formats import builtins
from qtool.formats.base import FloatReader, FormatContext, OutputFormat
from qtool.formats.detect import Detected, detect
from qtool.spec import FormatName, QSpec

if TYPE_CHECKING:
    from qtool.io.atomic import OutputSet
    from qtool.results import DequantizedRow, InspectSummary


@dataclass(frozen=True)
class FormatEntry:
    """One registered format. `output`: the writer `--format NAME` selects (None: read only);
    `reader`: what `detect` found, as float tensors (`qparams`: a sidecar named by hand);
    `inspect`: what `qtool inspect` shows of it; `belongings`: files beside an input file that
    belong to it (its sidecar), which no output may replace; `refuses`: why the output can
    store no tensor at all with a spec (None: it can), checked before any file is read."""

    name: str
    reader: Callable[[Detected, Path | None], FloatReader]
    inspect: Callable[[Detected], InspectSummary]
    output: Callable[[FormatContext], OutputFormat] | None = None
    belongings: Callable[[Path], list[Path]] | None = None
    refuses: Callable[[QSpec], str | None] | None = None


FloatWriter = Callable[
    ["FloatReader", Path, "OutputSet", str, Sequence[str]], list["DequantizedRow"]
]
"""Writes a reader's tensors `names` as a float checkpoint file (dtype: 'original' or a name)."""

_FORMATS: dict[str, FormatEntry] = {}
_FLOAT_WRITERS: list[FloatWriter] = []


def register(entry: FormatEntry) -> None:
    _FORMATS[entry.name] = entry


def register_float_writer(writer: FloatWriter) -> None:
    """The writer of float checkpoints (the dense format's), what dequantize writes."""
    _FLOAT_WRITERS.append(writer)


def write_float(
    reader: FloatReader, out: Path, outputs: OutputSet, dtype: str, names: Sequence[str]
) -> list[DequantizedRow]:
    """The float checkpoint `out` of the reader's tensors `names` (see FloatWriter)."""
    builtins.load()
    return _FLOAT_WRITERS[0](reader, out, outputs, dtype, names)


def entry(name: str) -> FormatEntry:
    builtins.load()
    return _FORMATS[str(getattr(name, "value", name))]


def output_names() -> list[str]:
    """The formats `--format` can write, by name."""
    builtins.load()
    return [name for name, e in _FORMATS.items() if e.output is not None]


def output_format(name: str, context: FormatContext | None = None) -> OutputFormat:
    """The output format registered under `name`, set up for this run's `context` (ValueError
    for an unknown name; InputError when the context does not fit the format)."""
    builtins.load()
    found = _FORMATS.get(str(getattr(name, "value", name)))
    if found is None or found.output is None:
        raise ValueError(f"unknown format {name!r}; choose one of {', '.join(output_names())}")
    return found.output(context or FormatContext())


def refuses(name: str, spec: QSpec) -> str | None:
    """Why the output format `name` can store no tensor at all with `spec`, or None."""
    found = entry(name)
    return None if found.refuses is None else found.refuses(spec)


def open_reader(path: Path | Detected, qparams: Path | None = None) -> FloatReader:
    """Any checkpoint, file or directory, as float tensors (quantized ones dequantized on the
    fly); `qparams` names the sidecar of a qtool-quantized file moved away from it."""
    found = path if isinstance(path, Detected) else detect(path)
    owner = found.format if qparams is None else FormatName.QTOOL.value  # whose sidecars
    return entry(owner).reader(found, qparams)


def inspect(found: Detected) -> InspectSummary:
    return entry(found.format).inspect(found)


def belongings(paths: list[Path]) -> list[Path]:
    """Every file that belongs to one of `paths` (a qtool file's sidecar), by every format."""
    builtins.load()
    hooks = [e.belongings for e in _FORMATS.values() if e.belongings is not None]
    return [q for p in paths for hook in hooks for q in hook(p)]
