"""A float GGUF type as the spec of a run that quantizes nothing: `quantize HF_DIR --format gguf
--dtype F16` writes the float GGUF llama.cpp's convert_hf_to_gguf.py writes (--outtype f16,
bf16, f32). Its tensors are cast, not quantized: the GGUF format converts a model directory
with it (formats/gguf/hf_export.py) and no kernel ever sees it. A recipe label never names
it (from_label: None), so rules and budgets keep their meaning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qtool.codecs.base import Codec
from qtool.gguf_types import FLOAT_TYPES, GGML_TYPES, GGMLType


@dataclass(frozen=True)
class GGUFFloatSpec(Codec, kind="gguf-float", what="a float GGUF type"):
    """F32, F16 or BF16 for the 2-D tensors of a converted model (1-D ones stay F32)."""

    gguf: GGMLType
    whole = True

    def __post_init__(self) -> None:
        if self.gguf.name not in FLOAT_TYPES:
            raise ValueError(f"{self.gguf.name} is not a float GGUF type: {', '.join(FLOAT_TYPES)}")

    @classmethod
    def from_label(cls, text: str, *, writable: bool = False) -> GGUFFloatSpec | None:
        return None  # "F16" in a recipe means keep-in-float's dtype, not this run

    def describe(self) -> str:
        return self.gguf.name

    def label(self) -> str:
        return self.gguf.name

    def to_json(self) -> dict[str, object]:
        t = self.gguf
        return {"gguf_type": t.name, "bits": t.bits_per_weight, "block_size": t.block_size,
                "block_bytes": t.type_size, "quantized": False}  # fmt: skip

    @property
    def tag(self) -> str:
        return self.gguf.name

    def fit(self, shape: tuple[int, ...]) -> tuple[GGUFFloatSpec, str]:
        return self, ""

    def stored_dtype(self) -> str:
        return self.gguf.name

    def code_layout(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], str, int]:
        return shape, self.gguf.name, 1  # the cast values, in the tensor's own shape

    @property
    def conversion(self) -> bool:
        return True

    def code_nbytes(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * self.gguf.type_size


def gguf_float_spec(name: str) -> GGUFFloatSpec:
    """The spec of float GGUF type `name` ('F16', any case); ValueError for any other name."""
    found = GGML_TYPES.get(name.upper())
    if found is None or found.name not in FLOAT_TYPES:
        raise ValueError(f"'{name}' is not a float GGUF type ({', '.join(FLOAT_TYPES)})")
    return GGUFFloatSpec(found)
