"""The seam every on-disk quantized format plugs into.

A format says what it can store (`supports`), which files one output shard occupies (`layout`),
takes the tensors of one shard from the quantize loop (`writer`), and gives any file it wrote
back as float tensors (`reader`, chosen by `detect`). The loop in engine/run.py knows nothing
else about it, so a second format (compressed-tensors) plugs in without touching the loop.
A format may also narrow the rules' plan over the whole model (`select`, `fused_key`), store a
tensor under other names (`tensor_names`, for the output index), write a model directory's own files
(`directory_files`: config.json), round scales to the weight's dtype before the codes are
computed (`scales_in_weight_dtype`), and say what will not run everywhere (`warnings`, `ignore`).
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from qtool.calibration import TextUse
from qtool.io.safeopen import InputDir
from qtool.io.stformat import TensorEntry
from qtool.spec import Codec, GroupFallback

if TYPE_CHECKING:
    import torch

    from qtool.io.atomic import OutputSet
    from qtool.numerics.kernels import QuantizedTensor


class Planned(Protocol):
    """What a format needs of one tensor's plan: the tensor, and its spec (None: kept)."""

    @property
    def entry(self) -> TensorEntry: ...

    @property
    def spec(self) -> Codec | None: ...


class Ruling(Protocol):
    """A tensor's decision as a format reads it (engine/decision.py's Decision)."""

    @property
    def reason(self) -> str:
        """Why it is kept ("" when quantized)."""

    @property
    def note(self) -> str:
        """How the spec was adapted to this tensor ("" when it was not)."""

    @property
    def asked(self) -> Codec | None:
        """The spec before qtool fitted it to the tensor (a group longer than a row is per
        channel for qtool; a format may refuse it instead); None: as `spec`."""

    @property
    def by_name(self) -> bool:
        """True when a rule decided by name (an --exclude, a recipe rule or an --include, or
        --include matching nothing); False for the default selection."""

    @property
    def rule_label(self) -> str:
        """The recipe run's rule that decided, for messages ("" without a recipe)."""

    @property
    def rule_origin(self) -> str:
        """Where that rule is written ("llm.toml: line 12: "; "" for a command-line rule)."""

    @property
    def budget(self) -> bool:
        """The error budget decides the tensor (it holds int8 per channel until it has)."""


class Ruled(Planned, Protocol):
    """A tensor's plan as the rules (--exclude, a recipe, --include) left it."""

    @property
    def decision(self) -> Ruling: ...


class ShardWriter(Protocol):
    """Receives the tensors of one shard, in `order`, then writes what remains and closes."""

    @property
    def order(self) -> Sequence[TensorEntry]:
        """The input tensors in the order the writer takes them."""

    def keep(self, entry: TensorEntry, data: memoryview) -> None:
        """A tensor stored as it is (its bytes as in the input)."""

    def quantized(self, entry: TensorEntry, spec: Codec, result: QuantizedTensor) -> None:
        """A quantized tensor; its codes stay valid only until this call returns."""

    def finish(self) -> None:
        """Everything after the last tensor (qparams, a rewritten header)."""


class Choice(Protocol):
    """A format's own decision for one tensor (see OutputFormat.select)."""

    @property
    def entry(self) -> TensorEntry: ...

    @property
    def spec(self) -> Codec | None: ...

    @property
    def reason(self) -> str:
        """Why it is kept ("" when quantized)."""

    @property
    def note(self) -> str:
        """How the spec was adapted to this tensor ("" when it was not)."""

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in this format's output."""

    @property
    def stored_dtype(self) -> str:
        """The dtype its codes are stored as (the tensor's own dtype when kept)."""


@dataclass(frozen=True)
class FormatContext:
    """What a run knows that a format may need: the model's config.json (None: there is none;
    read through `config_dir`, the model directory held open, when it lies there), what to do
    with tensors whose row length the group size does not divide, and the input's directory
    held open (None: a lone file), whose other files (modules.json) a format may look at."""

    config: Path | None = None
    group_fallback: GroupFallback = GroupFallback.ERROR
    config_dir: InputDir | None = None
    directory: InputDir | None = None
    inputs: tuple[Path, ...] = ()  # the checkpoint files the run reads (GGUF: its header)
    imatrix: Mapping[str, object] | None = None  # --imatrix: its provenance, for the metadata


class OutputFormat(abc.ABC):
    """An output format: `name` and `writer` are its own; every other member has the default
    of a format that stores each tensor under its name in one file per shard, with qtool's
    specs and sizes, and nothing else (a format overrides what it does differently)."""

    name: str
    model_directory: bool = False
    """True: the output is a model directory (config.json from `directory_files`), even for a
    single input file; it is built under a temporary name and renamed when complete."""
    scales_in_weight_dtype: bool = False
    """True: scales are rounded to the weight's dtype before the codes are computed."""
    keeps_tied_embedding: bool = False
    """True: the default selection keeps a tied input embedding (engine/tied.py) in float
    where it would quantize it to 4 bits (compressed-tensors never quantizes an embedding;
    GGUF decides by its own plan)."""
    texts: tuple[TextUse, ...] = ()
    """The texts a calibrated method or an imatrix used, for the formats that record them."""

    def with_texts(self, texts: Sequence[TextUse]) -> OutputFormat:
        """This format, recording `texts` in what it writes (known after the method's pass)."""
        out = copy.copy(self)
        out.texts = tuple(texts)
        return out

    def select(self, planned: Sequence[Ruled]) -> list[Choice] | None:
        """The format's decision for every tensor of the model in order (all shards at once,
        so a check can span shards), given the rules' plan; None: the plan stands as it is.
        Deciding again on its own output changes nothing."""
        return None

    def fused_key(self, name: str) -> str | None:
        """Tensors with the same key must be quantized alike (a consumer fuses them); None
        for a tensor with no such siblings."""
        return None

    def tensor_names(self, planned: Planned) -> list[str]:
        """The names the tensor is stored under (the output index maps each to its shard)."""
        return [planned.entry.name]

    def directory_files(self, planned: Sequence[Planned]) -> dict[str, bytes]:
        """Files of a model directory output the format writes itself (they replace companions
        of the same name), given the whole model's plan."""
        return {}

    def warnings(self, planned: Sequence[Planned]) -> list[str]:
        """One line per choice that will not run everywhere."""
        return []

    def ignore(self, planned: Sequence[Planned]) -> list[str] | None:
        """What the output's config lists as kept in float; None: the format has no such list."""
        return None

    def supports(self, entry: TensorEntry, spec: Codec) -> str | None:
        """None when the format can store `entry` quantized with `spec`; else why not."""
        return None

    def stored_nbytes(self, entry: TensorEntry, spec: Codec | None) -> int | None:
        """Bytes `entry` takes in this format's output quantized with `spec` (None: kept);
        None: qtool's count (its codes and a float32 scale and a zero point per group)."""
        return None

    def layout(self, out: Path) -> list[Path]:
        """Every file one output shard named `out` occupies (checked before writing);
        OutputError for a name the format cannot store."""
        return [out]

    def index_section(self, outputs: Sequence[Path]) -> dict[str, object] | None:
        """What a sharded output's index records of the format under its `qtool` key, given
        the output shards (None: nothing)."""
        return None

    @abc.abstractmethod
    def writer(
        self,
        planned: Sequence[Planned],
        metadata: dict[str, str] | None,
        out: Path,
        outputs: OutputSet,
    ) -> ShardWriter:
        """The writer of one shard named `out`, given its tensors' plan and the input's
        metadata (`outputs` holds the files being written)."""


class FloatReader(Protocol):
    """Any checkpoint's tensors as float values: quantized ones are dequantized on the fly."""

    path: Path

    @property
    def names(self) -> list[str]:
        """Tensor names in file order."""

    @property
    def metadata(self) -> dict[str, str] | None: ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical shape (codes may be stored packed)."""

    def dtype(self, name: str) -> str:
        """The logical dtype: a quantized tensor counts as its original dtype."""

    def quantization(self, name: str) -> Codec | None:
        """How the tensor was quantized; None when it is stored as it is."""

    def values(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor (dequantized to `dtype`, default its original dtype, if quantized)."""

    def raw(self, name: str) -> memoryview:
        """The stored bytes of a tensor that is not quantized."""

    def nbytes(self, name: str) -> int:
        """Bytes the tensor takes as stored (its codes, for a quantized tensor)."""

    def stored_dtype(self, name: str) -> str:
        """The dtype as stored (the codes' dtype, for a quantized tensor)."""

    def file_of(self, name: str) -> Path:
        """The weight file that holds the tensor (a directory's output mirrors its files)."""

    @property
    def sidecars(self) -> list[Path]:
        """The qtool sidecars read along ([] for other formats)."""

    def restored_files(self) -> dict[str, bytes]:
        """Files a float model directory restored from this one writes itself, in place of its
        copies of the same name (compressed-tensors: config.json without the quantization_config);
        {}: none."""

    def release(self, name: str) -> None:
        """Drop the pages of a tensor already consumed."""

    def check_unchanged(self) -> None: ...

    def close(self) -> None: ...


def carried_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    """The input's own metadata (e.g. {"format": "pt"}), minus qtool's keys."""
    return {k: v for k, v in (metadata or {}).items() if not k.startswith("qtool.")}
