"""Codec: the value type every quantization spec is, and the registry of codec families.

A codec is a frozen dataclass: its fields are the choices that family takes (an integer grid:
scheme, dtype, granularity, range method; a GGUF type: the type). Everything the engine,
formats, budget and reports need to know about a spec is a method here, so no module outside
a codec's own asks which family a spec is. A subclass registers itself by naming its family:

    @dataclass(frozen=True)
    class GGUFSpec(Codec, kind="gguf", what="a GGUF block type"):
        gguf: GGMLType
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

CODECS: dict[str, type[Codec]] = {}
"""Every codec family by kind, in the order registered (labels are tried in this order)."""


class Codec(abc.ABC):
    """One quantization spec (see the module doc). `kind` names the family (what a format
    lists as stored, the key of the registry); `what` names it in messages ("a GGUF block
    type"); `whole`: one named type fixes the whole layout (a GGUF type, never patched field
    by field): a run asked for it is named by it alone (as llama-quantize names its files),
    and a format that does not store it refuses it even under the error budget and in a
    recipe rule, before any tensor is read."""

    kind: ClassVar[str]
    what: ClassVar[str]
    whole: ClassVar[bool] = False

    def __init_subclass__(cls, kind: str = "", what: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not kind:
            raise TypeError(f"codec {cls.__name__} names no kind")
        if kind in CODECS and CODECS[kind].__qualname__ != cls.__qualname__:
            raise TypeError(f"codec kind {kind!r} is taken by {CODECS[kind].__name__}")
        cls.kind, cls.what = kind, what
        CODECS[kind] = cls

    # -- labels and JSON --------------------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def from_label(cls, text: str, *, writable: bool = False) -> Codec | None:
        """The codec a label names ('int4 g128 mse', 'Q4_K'), None when the label is not of
        this family; ValueError for one of this family that is wrong. `writable`: only what
        qtool quantizes to (a GGUF file read may name types qtool cannot write)."""

    @classmethod
    def names(cls, word: str) -> bool:
        """Whether a dtype word names a whole codec of this family ('Q6_K', any case)."""
        return False

    @classmethod
    def from_dtype(cls, word: str) -> Codec | None:
        """The whole codec a dtype word names on its own ('Q6_K'), None when the word is not
        one (an integer dtype only sets one field of a grid); ValueError when it names one
        qtool does not quantize to."""
        return None

    @abc.abstractmethod
    def describe(self) -> str:
        """Short label for tables: 'sym int8 axis 0', 'Q4_K'."""

    def describe_for(self, shape: tuple[int, ...]) -> str:
        """describe() with what the table says of it on a tensor of `shape` ('... (64x2
        groups)')."""
        return self.describe()

    @abc.abstractmethod
    def label(self) -> str:
        """The label from_label reads back: 'int4 g128 mse', 'Q4_K'."""

    @abc.abstractmethod
    def to_json(self) -> dict[str, object]:
        """The structured form reports and manifests use."""

    @property
    @abc.abstractmethod
    def tag(self) -> str:
        """What a default output name says of a run in this codec: 'int8', 'Q4_K'."""

    @property
    def refusal_hint(self) -> str:
        """The hint code of the option to change when a format refuses this spec."""
        return "dtype"

    # -- shapes and bytes -------------------------------------------------------------------

    @abc.abstractmethod
    def fit(self, shape: tuple[int, ...]) -> tuple[Codec, str]:
        """The spec as it applies to a tensor of `shape`, and a note when it changed;
        ValueError when it cannot apply (a channel axis the tensor lacks)."""

    @abc.abstractmethod
    def stored_dtype(self) -> str:
        """The dtype the tensor's codes are stored as: 'I8', 'U8', 'Q4_K'."""

    @abc.abstractmethod
    def code_layout(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], str, int]:
        """How the codes of a tensor of `shape` lie in memory: their shape, their safetensors
        dtype, and how many of their rows one row of the tensor's first dimension gives."""

    @abc.abstractmethod
    def code_nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of the codes (a block type: its blocks, scales inside) of a tensor of `shape`."""

    def qparam_groups(self, shape: tuple[int, ...]) -> int:
        """How many scales and zero points a tensor of `shape` has outside its codes."""
        return 0

    def sidecar_nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes a tensor of `shape` adds to a qparams sidecar."""
        return 0

    def restored_dtype(self, dtype: str) -> str:
        """The dtype a consumer restores a tensor of `dtype` stored in this codec to."""
        return dtype

    def codes_label(self, stored: str) -> str:
        """The codes' dtype as a table shows it, given the dtype they are stored as."""
        return stored

    @property
    def conversion(self) -> bool:
        """A run in this spec casts the model's values to a float type and quantizes nothing
        (`--dtype F16`): it converts the input, its tensors have no codes."""
        return False

    @property
    def nibbles(self) -> bool:
        """Codes are 4-bit integers, packed two to a byte (int4, uint4)."""
        return False

    @property
    def rows_alone(self) -> bool:
        """Each row of the [C, K] view is quantized on its own, so the tensor may be read and
        quantized a slab of rows at a time."""
        return False


def parse_label(text: str, *, writable: bool = False) -> Codec:
    """The codec `text` names, trying each family in the order registered (the last one,
    qtool's grid, says what is wrong with a label no family takes)."""
    for family in CODECS.values():
        found = family.from_label(text, writable=writable)
        if found is not None:
            return found
    raise ValueError(f"'{text}' names no spec")


def whole_family(word: str) -> type[Codec] | None:
    """The family a dtype word names a whole codec of ('Q6_K': GGUFSpec), or None."""
    return next((family for family in CODECS.values() if family.names(word)), None)
