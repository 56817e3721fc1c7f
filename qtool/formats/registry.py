"""Formats by name: each format package registers itself on import (as compressed-tensors'
compressors and gguf-py's quant types do), and the engine reaches every format through here:
`output_format` for `--format NAME`, `open_reader` and `inspect` for whatever `detect` found,
`open_matching` for a checkpoint read under another one's tensor names (GGUF against the
Hugging Face checkpoint it was converted from).

A format is a FormatEntry: its name, the help line `--format` shows, and what it can do, each
imported only when used (`lazy`): registering a format imports none of its modules, so the CLI
reads every entry at start-up for `--format`, and `inspect` and dry runs stay torch-free.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qtool.formats import builtins
from qtool.spec import Codec, FormatName

if TYPE_CHECKING:
    from qtool.formats.base import FloatReader, FormatContext, OutputFormat
    from qtool.formats.detect import Detected
    from qtool.io.atomic import OutputSet
    from qtool.results import DequantizedRow, InspectSummary


@dataclass(frozen=True)
class Matched:
    """A checkpoint's tensors under the names of another checkpoint of the same model (GGUF's
    `blk.0.attn_q.weight` as `model.layers.0.self_attn.q_proj.weight`, in that layout), and
    every name of either side that has no counterpart, with why (never silently dropped)."""

    reader: FloatReader
    unplaced: dict[str, str] = field(default_factory=dict)
    placed: dict[str, str] = field(default_factory=dict)  # the other's name -> its own


Matcher = Callable[["FloatReader", Sequence[str]], Matched]
"""Given an open reader of the format and the other checkpoint's names, the reader as Matched."""


FloatWriter = Callable[
    ["FloatReader", Path, "OutputSet", str, Sequence[str]], list["DequantizedRow"]
]
"""Writes a reader's tensors `names` as a float checkpoint file (dtype: 'original' or a name)."""


@dataclass(frozen=True)
class FormatEntry:
    """One registered format. `output`: the writer `--format NAME` selects (None: read only);
    `reader`: what `detect` found, as float tensors (`qparams`: a sidecar named by hand);
    `inspect`: what `qtool inspect` shows of it; `belongings`: files beside an input file that
    belong to it (its sidecar), which no output may replace; `refuses`: why the output can
    store no tensor at all with a spec (None: it can), checked before any file is read.

    `suffix`: what a file of its output is named with; `own_input`: its output quantizes only
    checkpoints of its own format, and those only it does (GGUF in, GGUF out); `ladder`: the
    error budget's default ladder for its output (None: qtool's); `matcher`: its tensors under
    another checkpoint's names (None: it names tensors as that checkpoint does);
    `dequantize_float`: dequantize converts its files even when no tensor is quantized;
    `float_output`: dequantize writes a float file of this format (named with `suffix`);
    `codecs`: the kinds of codec its output stores (qtool.codecs: "grid", "gguf"); a spec of
    any other kind is refused, in the words of `foreign` when it has its own (None: the
    registry's, naming the formats that store it); `budget_reference`: what the error budget's
    all-8-bit reference is stored as, in the totals line ("Q8_0" for GGUF);
    `transformers_loads`: eval has transformers load its model directories (their
    quantization_config says how) instead of dequantizing them through its reader.

    What `--format` shows and checks before any file is read: `help`, one line saying what the
    output is (the option's help lists every writable format's); `reads_config`: the output
    takes a model's config.json and a group fallback (`--config`, `--group-fallback`), which
    every other output refuses, saying why with `groups` (how it stores a group size that does
    not divide a row; "" says nothing)."""

    name: str
    reader: Callable[[Detected, Path | None], FloatReader]
    inspect: Callable[[Detected], InspectSummary]
    output: Callable[[FormatContext], OutputFormat] | None = None
    belongings: Callable[[Path], list[Path]] | None = None
    refuses: Callable[[Codec], str | None] | None = None
    suffix: str = ".safetensors"
    own_input: bool = False
    ladder: tuple[Codec, ...] | None = None
    matcher: Matcher | None = None
    dequantize_float: bool = False
    float_output: FloatWriter | None = None
    codecs: tuple[str, ...] = ("grid",)
    foreign: Callable[[Codec], str] | None = None
    budget_reference: str = "int8"
    transformers_loads: bool = False
    input_hint: str = ""  # own_input: how to make such an input (", converted by ...")
    # own_input: a model directory it converts into its own input first (engine/hf_gguf.py):
    # whether `path` is one, and the writer of the converted file (path, out, OutputSet)
    converts: Callable[[Path], bool] | None = None
    convert: Callable[..., object] | None = None
    help: str = ""
    reads_config: bool = False
    groups: str = ""
    # a file qtool writes that is no checkpoint (eval's logits): why no command but inspect
    # and the one named here reads it
    not_a_checkpoint: str = ""


@dataclass(frozen=True)
class Refusal:
    """Why an output format refuses an option, and a hint code naming what to change
    ("dtype", "axis", "config", "group-fallback"): the CLI spells it as its option."""

    message: str
    hint: str


_FORMATS: dict[str, FormatEntry] = {}


def lazy(module: str, name: str) -> Callable[..., Any]:
    """The function `name` of `module`, imported on its first call: how a format package
    registers its detectors and hooks without importing them."""

    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args)

    return call


_FLOAT_WRITERS: list[FloatWriter] = []


def register(entry: FormatEntry) -> None:
    _FORMATS[entry.name] = entry


def register_float_writer(writer: FloatWriter) -> None:
    """The writer of float checkpoints (the dense format's), what dequantize writes."""
    _FLOAT_WRITERS.append(writer)


def write_float(
    reader: FloatReader,
    out: Path,
    outputs: OutputSet,
    dtype: str,
    names: Sequence[str],
    own: str | None = None,
) -> list[DequantizedRow]:
    """The float checkpoint `out` of the reader's tensors `names` (see FloatWriter): in the
    format `own` (the input's) when it writes float files and `out` has its suffix."""
    builtins.load()
    found = _FORMATS.get(own) if own is not None else None
    if found is not None and found.float_output is not None and float_suffix(found, out):
        return found.float_output(reader, out, outputs, dtype, names)
    return _FLOAT_WRITERS[0](reader, out, outputs, dtype, names)


def float_suffix(found: FormatEntry, out: Path) -> bool:
    """Whether `out` names a float file of the format `found` writes (a .gguf for GGUF)."""
    return found.float_output is not None and out.suffix.lower() == found.suffix


def entry(name: str) -> FormatEntry:
    """The format registered under `name` (ValueError for an unknown name)."""
    builtins.load()
    found = _FORMATS.get(str(getattr(name, "value", name)))
    if found is None:
        raise ValueError(f"unknown format {name!r}; choose one of {', '.join(output_names())}")
    return found


def output_names() -> list[str]:
    """The formats `--format` can write, by name."""
    return [e.name for e in outputs()]


def outputs() -> list[FormatEntry]:
    """The formats `--format` can write, in the order registered (builtins.py's first)."""
    builtins.load()
    return [e for e in _FORMATS.values() if e.output is not None]


def option_refusal(name: str, *, config: bool, group_fallback: bool) -> Refusal | None:
    """Why the output format `name` refuses a model config (`config`) or a group fallback
    other than an error (`group_fallback`): only a format that reads a config takes them."""
    found = entry(name)
    if found.reads_config:
        return None
    takers = " or ".join(f"--format {e.name}" for e in outputs() if e.reads_config)
    if config:
        message = f"goes with {takers} (the {found.name} format reads no config.json)"
        return Refusal(message, "config")
    if group_fallback:
        why = f" ({found.groups})" if found.groups else ""
        return Refusal(f"goes with {takers}{why}", "group-fallback")
    return None


def spec_refusal(name: str, spec: Codec) -> Refusal | None:
    """`refuses`, with the hint code of what to change: the dtype for a codec the output does
    not store, else what the spec says of itself (Codec.refusal_hint)."""
    refused = refuses(name, spec)
    if refused is None:
        return None
    stored = spec.kind in entry(name).codecs
    return Refusal(refused, spec.refusal_hint if stored else "dtype")


def output_format(name: str, context: FormatContext | None = None) -> OutputFormat:
    """The output format registered under `name`, set up for this run's `context` (ValueError
    for an unknown name; InputError when the context does not fit the format)."""
    found = entry(name)
    if found.output is None:
        raise ValueError(f"unknown format {name!r}; choose one of {', '.join(output_names())}")
    from qtool.formats.base import FormatContext

    return found.output(context or FormatContext())


def refuses(name: str, spec: Codec) -> str | None:
    """Why the output format `name` can store no tensor at all with `spec`, or None."""
    found = entry(name)
    if spec.kind not in found.codecs:
        if found.foreign is not None:
            return found.foreign(spec)
        where = " or ".join(f"--format {e.name}" for e in outputs() if spec.kind in e.codecs)
        what = f"{spec.describe()} is {spec.what}"
        return f"{what}, which --format {found.name} does not store; use {where}"
    return None if found.refuses is None else found.refuses(spec)


def open_reader(path: Path | Detected, qparams: Path | None = None) -> FloatReader:
    """Any checkpoint, file or directory, as float tensors (quantized ones dequantized on the
    fly); `qparams` names the sidecar of a qtool-quantized file moved away from it."""
    from qtool.formats.detect import Detected, detect

    found = path if isinstance(path, Detected) else detect(path)
    owner = found.format if qparams is None else FormatName.QTOOL.value  # whose sidecars
    return entry(owner).reader(found, qparams)


def input_refusal(output: str, found: Detected) -> str | None:
    """Why `--format output` cannot quantize what `detect` found (None: it can)."""
    out, src = entry(output), entry(found.format)
    if out.own_input and src.name != out.name:
        what = f"a float {out.name.upper()} file, not {found.description}"
        return f"--format {out.name} quantizes {what}{out.input_hint}"
    if src.own_input and out.name != src.name:
        return f"{found.description} is quantized with --format {src.name}"
    return None


def matched(reader: FloatReader, found: Detected, names: Sequence[str]) -> Matched:
    """`reader` (what `detect` found, opened) under the names `names` of another checkpoint of
    the same model, when its format names tensors its own way (GGUF); else as it is."""
    matcher = entry(found.format).matcher
    if matcher is None:
        return Matched(reader)
    return matcher(reader, names)


def open_matching(path: Path | Detected, names: Sequence[str]) -> Matched:
    """The checkpoint at `path` as float tensors under the names `names` of another checkpoint
    of the same model (a Hugging Face float model's state dict names): a GGUF file's tensors
    come renamed and in that layout, with what could not be placed listed; any other format
    as it is. What an evaluation of a quantized file against its float model reads."""
    from qtool.formats.detect import Detected, detect

    found = path if isinstance(path, Detected) else detect(path)
    reader = open_reader(found)
    try:
        return matched(reader, found, names)
    except BaseException:
        reader.close()
        raise


def inspect(found: Detected) -> InspectSummary:
    return entry(found.format).inspect(found)


def belongings(paths: list[Path]) -> list[Path]:
    """Every file that belongs to one of `paths` (a qtool file's sidecar), by every format."""
    builtins.load()
    hooks = [e.belongings for e in _FORMATS.values() if e.belongings is not None]
    return [q for p in paths for hook in hooks for q in hook(p)]
