"""The vocabulary: schemes, storage dtypes, granularities, range methods and the codecs.

A spec is a Codec (qtool/codecs): qtool's integer grid, QSpec here (scheme, dtype, granularity,
range method; kind "grid"), or one of llama.cpp's GGUF block types, codecs/gguf.py's GGUFSpec
(Q8_0, Q4_K, ...; label "Q4_K"), whose type fixes the layout. Importing this module registers
both. Pure Python (no torch), so the CLI can start and `inspect` can answer without importing
torch.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, fields, replace
from typing import ClassVar

from qtool.codecs import base
from qtool.codecs.base import Codec as Codec
from qtool.codecs.base import whole_family as whole_family
from qtool.codecs.gguf import GGUF_QUANTIZE_TYPES as GGUF_QUANTIZE_TYPES
from qtool.codecs.gguf import GGUFSpec as GGUFSpec
from qtool.codecs.gguf import gguf_json as gguf_json
from qtool.codecs.gguf import gguf_nbytes as gguf_nbytes
from qtool.codecs.gguf import gguf_quantize_spec as gguf_quantize_spec
from qtool.codecs.gguf import gguf_spec as gguf_spec
from qtool.codecs.gguf import gguf_stored_type as gguf_stored_type
from qtool.codecs.gguf import is_gguf_name as is_gguf_name
from qtool.codecs.gguf_float import GGUFFloatSpec as GGUFFloatSpec
from qtool.codecs.gguf_float import gguf_float_spec as gguf_float_spec

SEMANTICS = "qtool"
"""Name of the numerical convention below; recorded in every sidecar."""
MSE_ALGORITHM = "qtool-mse-v1"
"""Name of the mse range search (numerics.ranges: candidate list and tie rule)."""


class Scheme(str, enum.Enum):
    """How the float range of a group maps onto the integer range.

    sym:  [-amax, amax] -> [qmin, qmax] with zero_point in the middle.
          int8, x = [-1.0, 0.3, 2.0]: scale = 2/127, zero_point = 0, q = [-64, 19, 127]
    asym: [min(x, 0), max(x, 0)] -> [qmin, qmax] (affine).
          uint8, same x: scale = 3/255, zero_point = 85, q = [0, 111, 255]
    """

    SYM = "sym"
    ASYM = "asym"


class StorageDtype(str, enum.Enum):
    """Integer type of the codes. 4-bit codes are stored packed, two per byte (U8)."""

    INT8 = "int8"
    UINT8 = "uint8"
    INT4 = "int4"
    UINT4 = "uint4"

    @property
    def bits(self) -> int:
        return 4 if self in (StorageDtype.INT4, StorageDtype.UINT4) else 8

    @property
    def signed(self) -> bool:
        return self in (StorageDtype.INT8, StorageDtype.INT4)

    @property
    def safetensors_dtype(self) -> str:
        """How the codes are stored: int8 as I8; uint8 and packed 4-bit codes as U8."""
        return "I8" if self is StorageDtype.INT8 else "U8"

    @property
    def packed(self) -> bool:
        return self.bits < 8


# 8-bit symmetric ranges are mirrored around zero_point, so -x is exactly as representable as
# x; 4-bit symmetric ranges use all sixteen levels (docs/numerics.md, "4-bit codes", says why).
_QRANGE: dict[tuple[Scheme, StorageDtype], tuple[int, int]] = {
    (Scheme.SYM, StorageDtype.INT8): (-127, 127),
    (Scheme.SYM, StorageDtype.UINT8): (1, 255),
    (Scheme.ASYM, StorageDtype.INT8): (-128, 127),
    (Scheme.ASYM, StorageDtype.UINT8): (0, 255),
    (Scheme.SYM, StorageDtype.INT4): (-8, 7),
    (Scheme.SYM, StorageDtype.UINT4): (0, 15),
    (Scheme.ASYM, StorageDtype.INT4): (-8, 7),
    (Scheme.ASYM, StorageDtype.UINT4): (0, 15),
}

_SYM_ZERO_POINT = {
    StorageDtype.INT8: 0,
    StorageDtype.UINT8: 128,
    StorageDtype.INT4: 0,
    StorageDtype.UINT4: 8,
}


@dataclass(frozen=True)
class PerTensor:
    """One scale and zero point for the whole tensor; qparams shape ()."""

    def describe(self) -> str:
        return "tensor"


@dataclass(frozen=True)
class PerChannel:
    """One scale per slice along `axis` (axis 0: output channels); qparams shape (C,)."""

    axis: int = 0

    def describe(self) -> str:
        return f"axis {self.axis}"


@dataclass(frozen=True)
class PerGroup:
    """Rows of the [C, K] view (C = shape[0]) cut into ceil(K / size) groups of `size`
    consecutive elements (the last may be shorter); qparams shape (C, ceil(K / size)).

    A [2, 5] tensor with size 2: row 0 -> groups [x00 x01] [x02 x03] [x04]; scale (2, 3).
    """

    size: int

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"group size must be at least 2, got {self.size}")

    def describe(self) -> str:
        return f"group {self.size}"


Granularity = PerTensor | PerChannel | PerGroup


def granularity_json(g: Granularity) -> dict[str, object]:
    """{"kind": "tensor"} / {"kind": "channel", "axis": 0} / {"kind": "group", "size": 128}."""
    if isinstance(g, PerChannel):
        return {"kind": "channel", "axis": g.axis}
    if isinstance(g, PerGroup):
        return {"kind": "group", "size": g.size}
    return {"kind": "tensor"}


def granularity_from_json(doc: object) -> Granularity:
    """Inverse of granularity_json; ValueError for anything else."""
    if not isinstance(doc, dict):
        raise ValueError(f"granularity {doc!r} is not an object")
    kind = doc.get("kind")
    if kind == "tensor" and set(doc) == {"kind"}:
        return PerTensor()
    if kind == "channel" and set(doc) == {"kind", "axis"} and type(doc["axis"]) is int:
        return PerChannel(doc["axis"])
    if kind == "group" and set(doc) == {"kind", "size"} and type(doc["size"]) is int:
        return PerGroup(doc["size"])
    raise ValueError(f"unknown granularity {doc!r}")


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(C, K): C = shape[0] rows of K = the product of the other dims (1-D: K = 1; 0-d: 1x1)."""
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:])


def qparam_shape(g: Granularity, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the scale and zero-point tensors of a tensor of `shape` (axis normalised)."""
    if isinstance(g, PerChannel):
        return (shape[g.axis],)
    if isinstance(g, PerGroup):
        c, k = matrix_shape(shape)
        return (c, math.ceil(k / g.size))
    return ()


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of 4-bit codes as stored, two per byte: [..., n] -> [..., ceil(n / 2)]; a 0-d
    tensor is stored as one byte."""
    if not shape:
        return (1,)
    return (*shape[:-1], (shape[-1] + 1) // 2)


class RangeMethod(str, enum.Enum):
    """How each group's float range is chosen before the qparams are computed.

    minmax: [min(x, 0), max(x, 0)] as it is.
    mse:    the candidate range (a fixed list of multiples of the min-max range) with the least
            squared reconstruction error; ties keep min-max, so it is never worse.
    """

    MINMAX = "minmax"
    MSE = "mse"


@dataclass(frozen=True)
class QSpec(Codec, kind="grid", what="an integer grid"):
    """qtool's integer grid: scheme, storage dtype, granularity and range method."""

    scheme: Scheme = Scheme.SYM
    dtype: StorageDtype = StorageDtype.INT8
    granularity: Granularity = PerChannel(0)
    range_method: RangeMethod = RangeMethod.MINMAX

    @property
    def qmin(self) -> int:
        return _QRANGE[self.scheme, self.dtype][0]

    @property
    def qmax(self) -> int:
        return _QRANGE[self.scheme, self.dtype][1]

    @property
    def symmetric_zero_point(self) -> int:
        """Zero point of every group under the symmetric scheme."""
        return _SYM_ZERO_POINT[self.dtype]

    @property
    def axis(self) -> int | None:
        """The channel axis, None per tensor; a group's rows are channels of axis 0."""
        g = self.granularity
        if isinstance(g, PerTensor):
            return None
        return g.axis if isinstance(g, PerChannel) else 0

    @classmethod
    def from_label(cls, text: str, *, writable: bool = False) -> QSpec:
        return _parse_grid_label(text)

    def describe(self) -> str:
        """Short label for tables: 'sym int8 axis 0', 'asym uint4 group 128 mse'."""
        label = f"{self.scheme.value} {self.dtype.value} {self.granularity.describe()}"
        return label if self.range_method is RangeMethod.MINMAX else f"{label} mse"

    def describe_for(self, shape: tuple[int, ...]) -> str:
        """'sym int4 group 128 (64x2 groups)': groups counted on a tensor of `shape`."""
        if not isinstance(self.granularity, PerGroup):
            return self.describe()
        c, n = qparam_shape(self.granularity, shape)
        return f"{self.describe()} ({c}x{n} groups)"

    def label(self) -> str:
        """'int4 g128 mse', 'asym int8 channel' (parse_spec_label reads it back)."""
        g = self.granularity
        if isinstance(g, PerGroup):
            gran = f"g{g.size}"
        elif isinstance(g, PerChannel):
            gran = "channel" if g.axis == 0 else f"axis{g.axis}"
        else:
            gran = "tensor"
        words = ["asym"] if self.scheme is Scheme.ASYM else []
        words += [self.dtype.value, gran]
        return " ".join(words + (["mse"] if self.range_method is RangeMethod.MSE else []))

    def to_json(self) -> dict[str, object]:
        return {
            "scheme": self.scheme.value,
            "dtype": self.dtype.value,
            "bits": self.dtype.bits,
            "granularity": granularity_json(self.granularity),
            "range_method": self.range_method.value,
            "qmin": self.qmin,
            "qmax": self.qmax,
        }

    @property
    def tag(self) -> str:
        return self.dtype.value

    @property
    def refusal_hint(self) -> str:
        """Unsigned codes are the dtype's to change; anything else a format refuses of a grid
        is its axis."""
        return "axis" if self.dtype.signed else "dtype"

    def fit(self, shape: tuple[int, ...]) -> tuple[QSpec, str]:
        """0-d/1-D -> per tensor, a group at least as long as a row -> per channel, the axis
        normalised. ValueError for a channel axis the tensor lacks."""
        g, ndim = self.granularity, len(shape)
        if ndim < 2 and not isinstance(g, PerTensor):
            return replace(self, granularity=PerTensor()), ""
        if isinstance(g, PerGroup):
            _, k = matrix_shape(shape)
            if g.size >= k:
                note = f"group {g.size} >= row length {k}: per channel"
                return replace(self, granularity=PerChannel(0)), note
        if isinstance(g, PerChannel):
            if not -ndim <= g.axis < ndim:
                raise ValueError(
                    f"axis {g.axis} is out of range for this {ndim}-D tensor; "
                    f"choose an axis in [{-ndim}, {ndim - 1}]"
                )
            return replace(self, granularity=PerChannel(g.axis % ndim)), ""
        return self, ""

    def stored_dtype(self) -> str:
        return self.dtype.safetensors_dtype

    def code_layout(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], str, int]:
        """The tensor's own shape (4-bit: packed two per byte along the last dimension)."""
        stored = packed_shape(shape) if self.dtype.packed else shape
        return tuple(stored), self.dtype.safetensors_dtype, 1

    def code_nbytes(self, shape: tuple[int, ...]) -> int:
        return math.prod(packed_shape(shape) if self.dtype.packed else shape)

    def qparam_groups(self, shape: tuple[int, ...]) -> int:
        return math.prod(qparam_shape(self.granularity, shape))

    def sidecar_nbytes(self, shape: tuple[int, ...]) -> int:
        """A float32 scale and a 1-byte zero point per group, and with the mse search the
        1-byte index of the range each group kept."""
        per_group = 6 if self.range_method is RangeMethod.MSE else 5
        return self.qparam_groups(shape) * per_group

    @property
    def nibbles(self) -> bool:
        return self.dtype.packed

    @property
    def rows_alone(self) -> bool:
        g = self.granularity
        return isinstance(g, PerGroup) or g == PerChannel(0)

    def codes_label(self, stored: str) -> str:
        """4-bit codes, stored two to a U8 byte, as what they are: 'I4' (int4), 'U4' (uint4)."""
        if self.dtype.packed and stored == "U8":
            return f"{'I' if self.dtype.signed else 'U'}{self.dtype.bits}"
        return stored


INT8_CHANNEL = QSpec(Scheme.SYM, StorageDtype.INT8, PerChannel(0), RangeMethod.MINMAX)
"""Sym int8 per output channel, min-max: the error budget's all-int8 reference, and the spec a
tensor the budget decides holds until the budget has chosen (every format stores it)."""


def as_grid(spec: Codec) -> QSpec:
    """`spec` as the integer grid a grid-only format or kernel takes; TypeError for any other
    codec (the registry refuses those for a format before any file is read)."""
    if not isinstance(spec, QSpec):
        raise TypeError(f"{spec.describe()} is {spec.what}, not an integer grid")
    return spec


def fit_spec(spec: Codec, shape: tuple[int, ...]) -> tuple[Codec, str]:
    """The spec as it applies to a tensor of `shape`, and a note when it changed (Codec.fit:
    a grid's granularity fitted, a GGUF type's fallback)."""
    return spec.fit(shape)


# -- labels: 'int4 g128 mse' ----------------------------------------------------------------


@dataclass(frozen=True)
class SpecPatch:
    """Some fields of a grid (a recipe rule's, a label's); None fields come from a base spec.
    Or a whole codec (`codec`, a GGUF type: no other field), which replaces the base."""

    scheme: Scheme | None = None
    dtype: StorageDtype | None = None
    granularity: Granularity | None = None
    range_method: RangeMethod | None = None
    codec: Codec | None = None

    def __post_init__(self) -> None:
        grid = (self.scheme, self.dtype, self.granularity, self.range_method)
        if self.codec is not None and any(f is not None for f in grid):
            raise ValueError(f"{self.codec.describe()} fixes its own block layout; it takes no "
                             "scheme, granularity, group size or range method")  # fmt: skip

    def apply(self, base: Codec) -> Codec:
        """`base` with this patch's fields put over it: a whole codec replaces it; grid fields
        over another codec go over QSpec's defaults (nothing of a block type carries)."""
        if self.codec is not None:
            return self.codec
        if not isinstance(base, QSpec):
            if self == SpecPatch():
                return base
            base = QSpec()
        return QSpec(
            self.scheme or base.scheme,
            self.dtype or base.dtype,
            self.granularity if self.granularity is not None else base.granularity,
            self.range_method or base.range_method,
        )


def spec_label(spec: Codec) -> str:
    """Short label, the inverse of parse_spec_label: 'int4 g128 mse', 'asym int8 channel',
    'Q4_K'."""
    return spec.label()


def parse_spec_label(text: str, *, writable: bool = False) -> Codec:
    """'int4 g128 mse' -> sym int4, groups of 128, mse. Words in any order, each kind at most
    once: sym|asym, the dtype (required), tensor|channel|axisN|gN, minmax|mse; unnamed fields
    are QSpec's defaults; or a GGUF type alone ('Q4_K', any case; `writable`: one qtool
    quantizes to). ValueError otherwise."""
    return base.parse_label(text, writable=writable)


def _parse_grid_label(text: str) -> QSpec:
    patch = SpecPatch()
    for word in text.split():
        part = _label_word(word)
        for field in fields(SpecPatch):
            value = getattr(part, field.name)
            if value is not None and getattr(patch, field.name) is not None:
                raise ValueError(f"'{text}' names the {field.name} twice")
            if value is not None:
                patch = replace(patch, **{field.name: value})
    if patch.dtype is None:
        raise ValueError(f"'{text}' names no dtype (int8, uint8, int4 or uint4)")
    spec = patch.apply(QSpec())
    assert isinstance(spec, QSpec)
    return spec


def _label_word(word: str) -> SpecPatch:
    """The one field a word of a label sets."""
    if word in ("sym", "asym"):
        return SpecPatch(scheme=Scheme(word))
    if word in {d.value for d in StorageDtype}:
        return SpecPatch(dtype=StorageDtype(word))
    if word in ("minmax", "mse"):
        return SpecPatch(range_method=RangeMethod(word))
    if word in ("tensor", "channel"):
        return SpecPatch(granularity=PerTensor() if word == "tensor" else PerChannel(0))
    number = re.fullmatch(r"(g|axis)(-?\d+)", word)
    if number is None:
        raise ValueError(
            f"unknown word '{word}'; use sym|asym, int8|uint8|int4|uint4, "
            "tensor|channel|axisN|gN and minmax|mse"
        )
    size = int(number[2])
    if number[1] == "axis":
        return SpecPatch(granularity=PerChannel(size))
    if size < 2:
        raise ValueError(f"group size {size} is too small; use 2 or more")
    return SpecPatch(granularity=PerGroup(size))


# -- the other choices a run makes (the CLI's option values; the engine takes the same) ----


class FormatName(str):
    """An output format's name, as `--format` takes it: any name a format registered
    (formats/registry.py knows which; a format package adds one without touching this).
    The built-in formats' names are constants here for callers that name one."""

    QTOOL: ClassVar[FormatName]
    COMPRESSED_TENSORS: ClassVar[FormatName]
    GGUF: ClassVar[FormatName]

    def __new__(cls, name: object) -> FormatName:
        return super().__new__(cls, getattr(name, "value", name))  # an enum member: its value

    @property
    def value(self) -> str:
        """The name as a plain string (as an enum member's value reads)."""
        return str.__str__(self)


FormatName.QTOOL = FormatName("qtool")
FormatName.COMPRESSED_TENSORS = FormatName("compressed-tensors")
FormatName.GGUF = FormatName("gguf")


class GroupFallback(str, enum.Enum):
    """What to do with a tensor whose row length K is not a multiple of the group size G
    (compressed-tensors and vLLM need whole groups).

    error:   refuse the plan, naming every such tensor (default)
    channel: quantize that tensor per channel instead
    keep:    keep that tensor in float (its module goes into `ignore`)
    """

    ERROR = "error"
    CHANNEL = "channel"
    KEEP = "keep"


class ImatrixUse(str, enum.Enum):
    """What an importance matrix given to quantize weighs.

    all:  the codes' search (range search, GGUF types' quant_weights) and an allocation's plan
    plan: an allocation's plan only (each tensor's spec); the codes are a run's without it
    """

    ALL = "all"
    PLAN = "plan"


class Device(str, enum.Enum):
    """Where the kernels run: auto picks CUDA when it is available, else the CPU."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class EvalDtype(str, enum.Enum):
    """The dtype `qtool eval` runs both models in (their weights are cast to it, exactly for
    float32 from bf16/fp16)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
