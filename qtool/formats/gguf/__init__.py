"""llama.cpp's GGUF as a qtool format, registered as FormatName.GGUF with one detector
(detect.PRIORITY places it: a lone file starting with the GGUF magic or named *.gguf).
Torch-free at import.

- reader.GGUFFloatReader: any GGUF file as float tensors (the FloatReader protocol), under GGUF
  names, in torch order, quantized types dequantized as ggml does (compare, dequantize).
- inspect / summary.summarize: what `inspect` shows (architecture, key metadata, every tensor
  with its type and bits per weight, totals by type).
- names.pair_names / HFView: the GGUF's tensors under the names and in the layout of the
  Hugging Face checkpoint it was converted from (rotary permutation undone); what cannot be
  placed is listed. `hf_state_dict` and registry.open_matching give them.
- output.GGUFFormat and shard.GGUFShardWriter: `quantize --format gguf`, a float GGUF
  (F32/F16/BF16) quantized through the quantize loop as llama-quantize writes it (plan.py: its
  float-kept tensors, fallbacks, order and file type).
- writer.write_quantized: the same at the library level, without the loop.
- dequantized.write_float_gguf: `dequantize X.gguf -o Y.gguf`, a float GGUF (every metadata
  value kept), which `quantize --format gguf` takes again: the way back from a quantized GGUF.
- ftype: llama.cpp's file types.
- hf_export / hf_vocab: a Llama, Mistral or Qwen2 model directory as the float GGUF llama.cpp's
  convert_hf_to_gguf.py writes (`quantize HF_DIR --format gguf` converts it first).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.codecs.gguf import gguf_choices
from qtool.errors import InputError, UsageError
from qtool.formats import detect, registry
from qtool.formats.detect import Detected, Probe
from qtool.spec import GGUF_QUANTIZE_TYPES, Codec, FormatName, GGUFSpec, gguf_spec

if TYPE_CHECKING:
    import torch

    from qtool.formats.base import FloatReader, FormatContext, OutputFormat
    from qtool.results import InspectSummary

NAME = FormatName.GGUF.value
MAGIC = b"GGUF"
PLAIN_TYPES = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")
LADDER: tuple[Codec, ...] = tuple(gguf_spec(t) for t in ("Q4_K", "Q5_K", "Q6_K", "Q8_0"))
"""The error budget's default ladder for --format gguf: llama.cpp's K-types, then Q8_0."""


def _gguf(probe: Probe) -> Detected | None:
    """A lone file with the GGUF magic, or named *.gguf (its reader says what is wrong)."""
    if probe.is_dir or probe.directory is not None:
        return None
    if probe.path.suffix.lower() != ".gguf" and not _has_magic(probe.path):
        return None
    from qtool.io.gguf_checkpoint import as_header
    from qtool.io.gguf_file import GGUFFile

    with GGUFFile(probe.path) as f:
        header = f.header
    types = {t.type.name for t in header.tensors} - set(PLAIN_TYPES)
    what = f"a GGUF file of {', '.join(sorted(types))} tensors" if types else "a float GGUF file"
    return Detected(
        probe.path, "gguf", NAME, what, bool(types), (probe.path,), header=as_header(header)
    )


def _has_magic(path: Path) -> bool:
    from qtool.io.safeopen import open_regular

    try:
        with open_regular(path) as f:
            return f.read(4) == MAGIC
    except InputError:
        return False  # not a regular file: the readers after this one say so


def _reader(found: Detected, qparams: Path | None) -> FloatReader:
    if qparams is not None:
        raise UsageError(qparams, "a GGUF file keeps its scales in its blocks; give no sidecar")
    from qtool.formats.gguf.reader import open_gguf

    return open_gguf(found.path)


def _inspect(found: Detected) -> InspectSummary:
    from qtool.formats.gguf.inspect import inspect

    return inspect(found.path)


def _output(context: FormatContext) -> OutputFormat:
    from qtool.formats.gguf.output import output_format

    return output_format(context.inputs, context.imatrix)


def _foreign(spec: Codec) -> str:
    return (f"--format gguf stores llama.cpp's block types, not {spec.describe()}: give one "
            f"of {gguf_choices()}")  # fmt: skip


def _refuses(spec: Codec) -> str | None:
    if not isinstance(spec, GGUFSpec):  # a float type: hf_export writes it from a directory
        return None
    if spec.gguf.name not in GGUF_QUANTIZE_TYPES:
        types = ", ".join(GGUF_QUANTIZE_TYPES)
        return f"qtool cannot quantize to {spec.gguf.name}; use one of {types}"
    return None


def _matcher(reader: FloatReader, names: Sequence[str]) -> registry.Matched:
    from qtool.formats.gguf.names import matched

    return matched(reader, names)


def hf_state_dict(
    path: Path, hf_names: Sequence[str]
) -> tuple[dict[str, torch.Tensor], registry.Matched]:
    """Every tensor of the GGUF file `path` that maps onto the Hugging Face names `hf_names`,
    as float32 in the Hugging Face layout (rotary permutation undone), and the matching with
    what could not be placed (registry.open_matching reads them one at a time instead)."""
    found = registry.open_matching(Path(path), hf_names)
    try:
        state = {name: found.reader.values(name) for name in found.placed}
    finally:
        found.reader.close()
    return state, found


detect.register("gguf", _gguf)
registry.register(
    registry.FormatEntry(
        NAME, _reader, _inspect, _output, refuses=_refuses, suffix=".gguf", own_input=True,
        ladder=LADDER, matcher=_matcher, dequantize_float=True, codecs=("gguf", "gguf-float"),
        foreign=_foreign, budget_reference="Q8_0",
        float_output=registry.lazy("qtool.formats.gguf.dequantized", "write_float_gguf"),
        converts=registry.lazy("qtool.formats.gguf.hf_export", "is_convertible"),
        convert=registry.lazy("qtool.formats.gguf.hf_export", "export_float"),
        input_hint=("; give a Llama, Mistral or Qwen2 model directory (converted first), or "
                    "convert others with llama.cpp's convert_hf_to_gguf.py"),
        help="a float GGUF quantized to GGUF types (--dtype Q4_K) that llama.cpp loads.",
        groups="GGUF types fall back as llama-quantize does",
    )
)  # fmt: skip
