"""`qtool quantize model-F16.gguf --format gguf --dtype Q4_K`: a float GGUF quantized tensor by
tensor into a GGUF llama.cpp loads, through the quantize loop like every output format
(formats/base.py's OutputFormat), so rules, recipes, the error budget, the table, the JSON and
the gates work as for the others.

What llama-quantize decides, this format decides (plan.py has it from llama-quant.cpp):
  - the tensors it keeps as they are, whatever was asked (1-D, norms, expert gates, ...);
  - rows that are not whole blocks: spec.fit_spec gives llama-quantize's fallback type (the
    note says so); where none fits (llama-quantize writes F16) the tensor is kept as it is;
  - the order of the tensors, the metadata (quantization version and file type set, split keys
    dropped) and the alignment (shard.py writes them).
A spec that is not a GGUF type is refused (a recipe rule's names the rule); a tensor the error
budget holds until it has chosen passes through.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.codecs.gguf import gguf_choices
from qtool.errors import InputError, OutputError, RecipeError, UsageError
from qtool.formats.base import Choice, OutputFormat, Planned, Ruled, ShardWriter
from qtool.formats.gguf.mixes import MIXES, ModelFacts, mix_types
from qtool.formats.gguf.plan import kept_by_llama
from qtool.formats.gguf.summary import ARCH_KEY, refuse_split
from qtool.gguf_types import FLOAT_TYPES, GGML_TYPES
from qtool.io.gguf_file import GGUFFile
from qtool.io.gguf_layout import align
from qtool.io.stformat import TensorEntry
from qtool.spec import GGUF_QUANTIZE_TYPES, Codec, FormatName, GGUFSpec, gguf_nbytes

if TYPE_CHECKING:
    from qtool.io.atomic import OutputSet

NAME = FormatName.GGUF.value
SUFFIX = ".gguf"
_Q8_0 = GGUFSpec(GGML_TYPES["Q8_0"])


@dataclass(frozen=True)
class GGUFChoice:
    """The format's decision for one tensor (formats.base.Choice)."""

    entry: TensorEntry
    spec: Codec | None
    reason: str = ""
    note: str = ""
    nbytes: int = 0
    stored_dtype: str = ""


class GGUFFormat(OutputFormat):
    """The GGUF output of one run, reading the float GGUF `source` (its header: the metadata,
    alignment and types the output carries over). No fused siblings: llama.cpp takes q, k and
    v of different types."""

    name = NAME

    def __init__(self, source: Path, imatrix: Mapping[str, object] | None = None) -> None:
        """`imatrix`: the provenance of an importance matrix the run quantizes with, written as
        llama-quantize's quantize.imatrix.* keys."""
        self.imatrix = imatrix
        with GGUFFile(source) as f:
            self.header = f.header
        refuse_split(source, self.header)
        self.source = source
        arch = self.header.metadata.get(ARCH_KEY)
        self.arch = arch.value if arch is not None and isinstance(arch.value, str) else ""
        self._mixes: dict[str, dict[str, str]] = {}
        self._wanted: dict[str, dict[str, str]] = {}  # per mix: the types rows fell back from
        self.file_type: int | None = None  # a mix's general.file_type, once select has run

    def select(self, planned: Sequence[Ruled]) -> list[Choice]:
        choices: list[Choice] = [self._choice(p) for p in planned]
        mixes = {p.spec.mix for p in planned if isinstance(p.spec, GGUFSpec) and p.spec.mix}
        # llama-quantize writes its file type whatever --tensor-type overrides
        self.file_type = MIXES[next(iter(mixes))].ftype if len(mixes) == 1 else None
        return choices

    def _unmixed(self, entry: TensorEntry, spec: GGUFSpec) -> tuple[GGUFSpec, str]:
        """The type llama-quantize gives `entry` in `spec`'s mix (mixes.py, over the whole
        model), with a note when a rule of the mix changed it; a tensor the mix leaves out
        (llama-quantize keeps it) gets the mix's default type, which supports() then keeps."""
        if spec.mix not in self._mixes:
            try:
                facts = ModelFacts.of(self.header.metadata)
                facts.check_blocks(self.header.tensors)
                wanted = self._wanted[spec.mix] = {}
                self._mixes[spec.mix] = mix_types(
                    MIXES[spec.mix], self.header.tensors, facts, wanted=wanted
                )
            except ValueError as err:
                raise InputError(
                    self.source, f"{spec.mix} needs the model's shape: {err}"
                ) from None
        found = self._mixes[spec.mix].get(entry.name)
        if found is None or found in FLOAT_TYPES:  # kept, or F16: supports() says why
            return GGUFSpec(spec.gguf), ""
        asked = spec.mix if found == spec.gguf.name else f"{spec.mix}: {found}"
        fell_from = self._wanted[spec.mix].get(entry.name)
        if fell_from is not None:
            asked = f"{spec.mix}: {fell_from}; {_not_whole(entry.shape[-1], fell_from)}: {found}"
        fitted, note = GGUFSpec(GGML_TYPES[found]).fit(entry.shape)
        return fitted, f"{asked}, {note}" if note else asked

    def _choice(self, planned: Ruled) -> GGUFChoice:
        entry, spec = planned.entry, planned.spec
        mix_note = ""
        if isinstance(spec, GGUFSpec) and spec.mix:
            spec, mix_note = self._unmixed(entry, spec)
        if spec is None:
            nbytes = self._padded(entry.nbytes)
            return GGUFChoice(entry, None, planned.decision.reason, "", nbytes, entry.dtype)
        if not isinstance(spec, GGUFSpec):
            decision = planned.decision
            if decision.budget:  # the budget holds it (int8 per channel) until it has chosen
                nbytes = self.stored_nbytes(entry, spec)
                return GGUFChoice(entry, spec, "", decision.note, nbytes, "Q8_0")
            if decision.rule_origin:
                where = f"{decision.rule_origin}{decision.rule_label}: "
                raise RecipeError(None, where + _not_gguf(spec), entry.name)
            raise UsageError(None, _not_gguf(spec), entry.name, hint="dtype")
        why = self.supports(entry, spec)
        if why is not None:
            return GGUFChoice(entry, None, why, "", self._padded(entry.nbytes), entry.dtype)
        nbytes = self._padded(gguf_nbytes(spec, entry.shape))
        note = "; ".join(n for n in (planned.decision.note, mix_note) if n)
        return GGUFChoice(entry, spec, "", note, nbytes, spec.gguf.name)

    def supports(self, entry: TensorEntry, spec: Codec) -> str | None:
        """None when llama.cpp takes `entry` quantized with `spec` (fitted: its fallback type
        already), else why it is kept as it is."""
        if not isinstance(spec, GGUFSpec):
            return _not_gguf(spec)
        why = kept_by_llama(entry.name, tuple(reversed(entry.shape)), self.arch)
        if why is not None:
            return why
        if entry.dtype not in FLOAT_TYPES:
            return f"already {entry.dtype}: qtool quantizes F32, F16 and BF16 tensors"
        if spec.gguf.name not in GGUF_QUANTIZE_TYPES:
            return f"qtool cannot quantize to {spec.gguf.name}"
        row = entry.shape[-1]
        if row % spec.gguf.block_size:
            return (f"rows of {row} are not whole {spec.gguf.name} blocks nor its fallback's: "
                    "kept as it is (llama-quantize writes F16)")  # fmt: skip
        return None

    def stored_nbytes(self, entry: TensorEntry, spec: Codec | None) -> int:
        """Bytes in the output, the padding to the file's alignment after it included; an
        integer spec (the budget's all-int8 reference) counts as Q8_0, GGUF's 8-bit type."""
        if spec is None:
            return self._padded(entry.nbytes)
        gguf = spec if isinstance(spec, GGUFSpec) else _Q8_0
        fitted, _ = gguf.fit(entry.shape)
        if self.supports(entry, fitted) is not None:
            return self._padded(entry.nbytes)
        return self._padded(gguf_nbytes(fitted, entry.shape))

    def _padded(self, nbytes: int) -> int:
        """A tensor's bytes in the file: its data and the zeros after it up to the alignment
        (the input's general.alignment, up to 64 KiB: a padding the report must count)."""
        return align(nbytes, self.header.alignment)

    def layout(self, out: Path) -> list[Path]:
        if out.suffix.lower() != SUFFIX:
            raise OutputError(out, f"a GGUF output is a {SUFFIX} file; name it so")
        return [out]

    def writer(
        self,
        planned: Sequence[Planned],
        metadata: dict[str, str] | None,
        out: Path,
        outputs: OutputSet,
    ) -> ShardWriter:
        from qtool.formats.gguf.shard import GGUFShardWriter
        from qtool.formats.gguf.writer import imatrix_metadata

        return GGUFShardWriter(
            self.header, planned, out, outputs, self.file_type, imatrix_metadata(self.imatrix)
        )


def _not_whole(row: int, qtype: str) -> str:
    """Why rows of `row` weights fall back from `qtype` (llama-quantize's fallback)."""
    block = GGML_TYPES[qtype].block_size
    what = "super-blocks" if block == 256 else "blocks"
    return f"rows of {row} are not whole {qtype} {what} ({block})"


def _not_gguf(spec: Codec) -> str:
    return (f"{spec.describe()} is not a GGUF type; --format gguf stores llama.cpp's block "
            f"types ({gguf_choices()})")  # fmt: skip


def output_format(
    inputs: Sequence[Path], imatrix: Mapping[str, object] | None = None
) -> GGUFFormat:
    """The GGUF output of a run reading `inputs` (one float GGUF file), quantized with the
    importance matrix whose provenance is `imatrix` (if any)."""
    if len(inputs) != 1:
        raise InputError(None, "--format gguf quantizes one float GGUF file")
    return GGUFFormat(inputs[0], imatrix)
