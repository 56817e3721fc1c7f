"""llama.cpp's block types as a codec: GGUFSpec('Q4_K'), whose type fixes the whole layout
(blocks of block_size elements in type_size bytes, scales inside). Its kernels are
numerics/gguf's (byte-identical to llama.cpp's reference quantizers); the GGUF format
(formats/gguf) is the only output that stores it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qtool.codecs.base import Codec
from qtool.gguf_types import FLOAT_TYPES, GGML_TYPES, GGMLType, fallback_type

GGUF_QUANTIZE_TYPES = (
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
"""The GGUF types qtool quantizes to, byte-identical to llama.cpp's reference quantizers (a
GGUF file read may hold any other; its tensors' specs name those too)."""
GGUF_MIXES = {"Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K", "Q4_K_S": "Q4_K",
              "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K"}  # fmt: skip
"""llama.cpp's named mixes (`llama-quantize in.gguf out.gguf Q4_K_M`) qtool writes, with the
type of the tensors no rule of the mix changes; the GGUF format gives each tensor its type
(formats/gguf/mixes.py). A type's own name stays that type alone (llama-quantize --pure)."""


def gguf_choices() -> str:
    """What --dtype takes for a GGUF output, as a message lists it: the types, then the mixes."""
    return f"{', '.join(GGUF_QUANTIZE_TYPES)}, or a mix: {', '.join(GGUF_MIXES)}"


_NOT_BLOCKS = (*FLOAT_TYPES, "F64", "I8", "I16", "I32", "I64")


@dataclass(frozen=True)
class GGUFSpec(Codec, kind="gguf", what="a GGUF block type"):
    """A GGUF block type ('Q4_K'); build one with gguf_spec. Its label is the type's name."""

    gguf: GGMLType
    mix: str = ""  # a named mix (GGUF_MIXES): gguf is its default type until the format decides
    whole = True

    def __post_init__(self) -> None:
        if self.gguf.name in _NOT_BLOCKS:
            raise ValueError(f"{self.gguf.name} is not a quantized GGUF type (a tensor of it "
                             "is kept)")  # fmt: skip
        if self.mix and GGUF_MIXES.get(self.mix) != self.gguf.name:
            raise ValueError(f"{self.mix} is not a llama.cpp mix of {self.gguf.name}")

    @classmethod
    def from_label(cls, text: str, *, writable: bool = False) -> GGUFSpec | None:
        words = text.split()
        if not any(is_gguf_name(w) or w.upper() in GGUF_MIXES for w in words):
            return None
        if len(words) > 1:
            raise ValueError(f"'{text}': a GGUF type fixes its block layout; name it alone")
        if words[0].upper() in GGUF_MIXES:
            return gguf_mix(words[0])
        return gguf_quantize_spec(words[0]) if writable else gguf_spec(words[0])

    @classmethod
    def names(cls, word: str) -> bool:
        return is_gguf_name(word) or word.upper() in GGUF_MIXES

    @classmethod
    def from_dtype(cls, word: str) -> GGUFSpec | None:
        if word.upper() in GGUF_MIXES:
            return gguf_mix(word)
        return gguf_quantize_spec(word) if is_gguf_name(word) else None

    def describe(self) -> str:
        return self.mix or self.gguf.name

    def label(self) -> str:
        return self.mix or self.gguf.name

    def to_json(self) -> dict[str, object]:
        return {**gguf_json(self.gguf), "mix": self.mix} if self.mix else gguf_json(self.gguf)

    @property
    def tag(self) -> str:
        return self.mix or self.gguf.name

    def fit(self, shape: tuple[int, ...]) -> tuple[GGUFSpec, str]:
        """A type whose blocks do not fit the rows of a 2+-D tensor becomes llama-quantize's
        fallback type (Q4_K -> Q5_0); when no block type fits (llama-quantize writes F16) it
        is left as it is, for the GGUF format to keep. A mix is left as it is: the GGUF format
        gives each tensor its type (and that type's fallback) over the whole model."""
        if len(shape) < 2 or self.mix:
            return self, ""
        stored = gguf_stored_type(self, shape)
        if stored == self.gguf or stored.name in _NOT_BLOCKS:
            return self, ""
        note = f"fallback: rows of {shape[-1]} are not whole {self.gguf.name} blocks"
        return GGUFSpec(stored), note

    def stored_dtype(self) -> str:
        return self.gguf.name

    def code_layout(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], str, int]:
        """(rows, row_bytes) blocks: one row per row of the dims but the last."""
        per_row = math.prod(shape[1:-1])
        return (shape[0] * per_row, self.gguf.row_bytes(shape[-1])), "U8", per_row

    def code_nbytes(self, shape: tuple[int, ...]) -> int:
        return gguf_nbytes(self, shape)

    def restored_dtype(self, dtype: str) -> str:
        return "F32"  # ggml dequantizes to float32

    @property
    def rows_alone(self) -> bool:
        return True


def gguf_spec(name: str | GGMLType) -> GGUFSpec:
    """The spec of GGUF block type `name` ('Q4_K', 'q4_k'); ValueError for a name ggml does
    not define, or for one that is not a quantized block type (F16, I32)."""
    if isinstance(name, GGMLType):
        return GGUFSpec(name)
    found = GGML_TYPES.get(name.upper())
    if found is None:
        raise ValueError(f"'{name}' is not a GGUF type; use one of {gguf_choices()}")
    return GGUFSpec(found)


def gguf_mix(name: str) -> GGUFSpec:
    """The spec of llama.cpp's mix `name` ('Q4_K_M', any case; GGUF_MIXES); ValueError else."""
    mix = name.upper()
    if mix not in GGUF_MIXES:
        raise ValueError(f"'{name}' is not a llama.cpp mix; use one of {', '.join(GGUF_MIXES)}")
    return GGUFSpec(GGML_TYPES[GGUF_MIXES[mix]], mix)


def gguf_quantize_spec(name: str) -> GGUFSpec:
    """The spec of a GGUF type qtool quantizes to ('Q4_K', any case; GGUF_QUANTIZE_TYPES);
    ValueError naming those for any other name."""
    found = GGML_TYPES.get(name.upper())
    if found is None or found.name not in GGUF_QUANTIZE_TYPES:
        what = "a GGUF type qtool quantizes to" if found is not None else "a GGUF type"
        raise ValueError(f"'{name}' is not {what}; use one of {gguf_choices()}")
    return GGUFSpec(found)


def is_gguf_name(word: str) -> bool:
    """Whether `word` names a quantized GGUF block type (any case)."""
    found = GGML_TYPES.get(word.upper())
    return found is not None and found.name not in _NOT_BLOCKS


def gguf_json(t: GGMLType) -> dict[str, object]:
    """A GGUF spec's structured form: {"gguf_type": "Q4_K", "bits": 4.5, "block_size": 256,
    "block_bytes": 144} (bits per weight, scales included)."""
    return {"gguf_type": t.name, "bits": t.bits_per_weight, "block_size": t.block_size,
            "block_bytes": t.type_size}  # fmt: skip


def gguf_stored_type(codec: GGUFSpec, shape: tuple[int, ...]) -> GGMLType:
    """The type llama-quantize stores a tensor of torch `shape` as when asked for `codec`'s:
    the type itself when rows (the last dim, ggml's ne[0]) are whole blocks, else its fallback
    (Q4_K -> Q5_0, Q6_K -> Q8_0, ...), else F16 (gguf_types.fallback_type)."""
    return fallback_type(codec.gguf, shape[-1] if shape else 1)


def gguf_nbytes(spec: GGUFSpec, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of torch `shape` takes stored as gguf_stored_type says."""
    t = gguf_stored_type(spec, shape)
    row = shape[-1] if shape else 1
    return t.row_bytes(row) * math.prod(shape[:-1])
