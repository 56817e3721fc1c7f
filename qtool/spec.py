"""The vocabulary: schemes, storage dtypes, granularities, range methods and the QSpec.

A QSpec is either qtool's integer grid (scheme, dtype, granularity, range method) or one of
llama.cpp's GGUF block types (`gguf`: Q8_0, Q4_K, Q6_K, ...; label "Q4_K"), whose layout the
type fixes (see gguf_spec). Pure Python (no torch), so the CLI can start and `inspect` can
answer without importing torch.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, fields, replace
from typing import ClassVar

from qtool.gguf_types import FLOAT_TYPES, GGML_TYPES, GGMLType, fallback_type

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
class QSpec:
    """One quantization recipe: scheme, storage dtype, granularity and range method; or, with
    `gguf` set, a GGUF block type (the other fields then keep their defaults and mean nothing:
    build one with gguf_spec; qmin, qmax, symmetric_zero_point and axis refuse it)."""

    scheme: Scheme = Scheme.SYM
    dtype: StorageDtype = StorageDtype.INT8
    granularity: Granularity = PerChannel(0)
    range_method: RangeMethod = RangeMethod.MINMAX
    gguf: GGMLType | None = None

    def __post_init__(self) -> None:
        if self.gguf is not None:
            _check_gguf(self)

    @property
    def qmin(self) -> int:
        return _QRANGE[self.scheme, self._int_dtype()][0]

    @property
    def qmax(self) -> int:
        return _QRANGE[self.scheme, self._int_dtype()][1]

    @property
    def symmetric_zero_point(self) -> int:
        """Zero point of every group under the symmetric scheme."""
        return _SYM_ZERO_POINT[self._int_dtype()]

    @property
    def axis(self) -> int | None:
        """The channel axis, None per tensor; a group's rows are channels of axis 0."""
        self._int_dtype()
        g = self.granularity
        if isinstance(g, PerTensor):
            return None
        return g.axis if isinstance(g, PerChannel) else 0

    def _int_dtype(self) -> StorageDtype:
        if self.gguf is not None:
            raise ValueError(f"{self.gguf.name} is a GGUF block type, not an integer grid")
        return self.dtype

    def describe(self) -> str:
        """Short label for tables: 'sym int8 axis 0', 'asym uint4 group 128 mse', 'Q4_K'."""
        if self.gguf is not None:
            return self.gguf.name
        label = f"{self.scheme.value} {self.dtype.value} {self.granularity.describe()}"
        return label if self.range_method is RangeMethod.MINMAX else f"{label} mse"

    def to_json(self) -> dict[str, object]:
        """The structured form reports and manifests use (a GGUF type: gguf_json)."""
        if self.gguf is not None:
            return gguf_json(self.gguf)
        return {
            "scheme": self.scheme.value,
            "dtype": self.dtype.value,
            "bits": self.dtype.bits,
            "granularity": granularity_json(self.granularity),
            "range_method": self.range_method.value,
            "qmin": self.qmin,
            "qmax": self.qmax,
        }


INT8_CHANNEL = QSpec(Scheme.SYM, StorageDtype.INT8, PerChannel(0), RangeMethod.MINMAX)
"""Sym int8 per output channel, min-max: the error budget's all-int8 reference, and the spec a
tensor the budget decides holds until the budget has chosen (every format stores it)."""


# -- GGUF block types: 'Q4_K' ------------------------------------------------------------

GGUF_QUANTIZE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
"""The GGUF types qtool quantizes to, byte-identical to llama.cpp's reference quantizers (a
GGUF file read may hold any other; its tensors' specs name those too)."""
_NOT_BLOCKS = (*FLOAT_TYPES, "F64", "I8", "I16", "I32", "I64")


def gguf_spec(name: str | GGMLType) -> QSpec:
    """The QSpec of GGUF block type `name` ('Q4_K', 'q4_k'); ValueError for a name ggml does
    not define, or for one that is not a quantized block type (F16, I32)."""
    if isinstance(name, GGMLType):
        return QSpec(gguf=name)
    found = GGML_TYPES.get(name.upper())
    if found is None:
        raise ValueError(
            f"'{name}' is not a GGUF type; use one of {', '.join(GGUF_QUANTIZE_TYPES)}"
        )
    return QSpec(gguf=found)


def gguf_quantize_spec(name: str) -> QSpec:
    """The spec of a GGUF type qtool quantizes to ('Q4_K', any case; GGUF_QUANTIZE_TYPES);
    ValueError naming those for any other name."""
    found = GGML_TYPES.get(name.upper())
    if found is None or found.name not in GGUF_QUANTIZE_TYPES:
        what = "a GGUF type qtool quantizes to" if found is not None else "a GGUF type"
        raise ValueError(f"'{name}' is not {what}; use one of {', '.join(GGUF_QUANTIZE_TYPES)}")
    return QSpec(gguf=found)


def is_gguf_name(word: str) -> bool:
    """Whether `word` names a quantized GGUF block type (any case)."""
    found = GGML_TYPES.get(word.upper())
    return found is not None and found.name not in _NOT_BLOCKS


def _check_gguf(spec: QSpec) -> None:
    t = spec.gguf
    assert t is not None
    if t.name in _NOT_BLOCKS:
        raise ValueError(f"{t.name} is not a quantized GGUF type (a tensor of it is kept)")
    if (spec.scheme, spec.dtype, spec.granularity, spec.range_method) != _INT_DEFAULTS:
        raise ValueError(f"{t.name} fixes its own block layout; it takes no scheme, dtype, "
                         "granularity or range method")  # fmt: skip


_INT_DEFAULTS = (Scheme.SYM, StorageDtype.INT8, PerChannel(0), RangeMethod.MINMAX)


def gguf_json(t: GGMLType) -> dict[str, object]:
    """A GGUF spec's structured form: {"gguf_type": "Q4_K", "bits": 4.5, "block_size": 256,
    "block_bytes": 144} (bits per weight, scales included)."""
    return {"gguf_type": t.name, "bits": t.bits_per_weight, "block_size": t.block_size,
            "block_bytes": t.type_size}  # fmt: skip


def gguf_stored_type(spec: QSpec, shape: tuple[int, ...]) -> GGMLType:
    """The type llama-quantize stores a tensor of torch `shape` as when asked for `spec`'s:
    the type itself when rows (the last dim, ggml's ne[0]) are whole blocks, else its fallback
    (Q4_K -> Q5_0, Q6_K -> Q8_0, ...), else F16 (gguf_types.fallback_type)."""
    if spec.gguf is None:
        raise ValueError(f"{spec.describe()} is not a GGUF type")
    return fallback_type(spec.gguf, shape[-1] if shape else 1)


def gguf_nbytes(spec: QSpec, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of torch `shape` takes stored as gguf_stored_type says."""
    t = gguf_stored_type(spec, shape)
    row = shape[-1] if shape else 1
    return t.row_bytes(row) * math.prod(shape[:-1])


def fit_spec(spec: QSpec, shape: tuple[int, ...]) -> tuple[QSpec, str]:
    """The spec as it applies to a tensor of `shape`, and a note when it changed: 0-d/1-D ->
    per tensor, a group at least as long as a row -> per channel, the axis normalised.
    ValueError for a channel axis the tensor lacks. A GGUF type whose blocks do not fit the
    rows of a 2+-D tensor becomes llama-quantize's fallback type (Q4_K -> Q5_0); when no block
    type fits (llama-quantize writes F16) it is left as it is, for the GGUF format to keep."""
    if spec.gguf is not None:
        return _fit_gguf(spec, shape)
    g, ndim = spec.granularity, len(shape)
    if ndim < 2 and not isinstance(g, PerTensor):
        return replace(spec, granularity=PerTensor()), ""
    if isinstance(g, PerGroup):
        _, k = matrix_shape(shape)
        if g.size >= k:
            note = f"group {g.size} >= row length {k}: per channel"
            return replace(spec, granularity=PerChannel(0)), note
    if isinstance(g, PerChannel):
        if not -ndim <= g.axis < ndim:
            raise ValueError(
                f"axis {g.axis} is out of range for this {ndim}-D tensor; "
                f"choose an axis in [{-ndim}, {ndim - 1}]"
            )
        return replace(spec, granularity=PerChannel(g.axis % ndim)), ""
    return spec, ""


def _fit_gguf(spec: QSpec, shape: tuple[int, ...]) -> tuple[QSpec, str]:
    assert spec.gguf is not None
    if len(shape) < 2:
        return spec, ""
    stored = gguf_stored_type(spec, shape)
    if stored == spec.gguf or stored.name in _NOT_BLOCKS:
        return spec, ""
    t = spec.gguf
    note = f"fallback: rows of {shape[-1]} are not whole {t.name} blocks"
    return QSpec(gguf=stored), note


# -- labels: 'int4 g128 mse' ----------------------------------------------------------------


@dataclass(frozen=True)
class SpecPatch:
    """Some fields of a spec (a recipe rule's, a label's); None fields come from a base spec."""

    scheme: Scheme | None = None
    dtype: StorageDtype | None = None
    granularity: Granularity | None = None
    range_method: RangeMethod | None = None
    gguf: GGMLType | None = None  # a GGUF block type: the whole spec, no other field

    def __post_init__(self) -> None:
        integer = (self.scheme, self.dtype, self.granularity, self.range_method)
        if self.gguf is not None and any(f is not None for f in integer):
            raise ValueError(f"{self.gguf.name} fixes its own block layout; it takes no "
                             "scheme, granularity, group size or range method")  # fmt: skip

    def apply(self, base: QSpec) -> QSpec:
        """`base` with this patch's fields put over it: a GGUF type replaces it whole; integer
        fields over a GGUF base go over QSpec's defaults (nothing of a block type carries)."""
        if self.gguf is not None:
            return QSpec(gguf=self.gguf)
        if base.gguf is not None:
            if self == SpecPatch():
                return base
            base = QSpec()
        return QSpec(
            self.scheme or base.scheme,
            self.dtype or base.dtype,
            self.granularity if self.granularity is not None else base.granularity,
            self.range_method or base.range_method,
        )


def spec_label(spec: QSpec) -> str:
    """Short label, the inverse of parse_spec_label: 'int4 g128 mse', 'asym int8 channel',
    'Q4_K'."""
    if spec.gguf is not None:
        return spec.gguf.name
    g = spec.granularity
    if isinstance(g, PerGroup):
        gran = f"g{g.size}"
    elif isinstance(g, PerChannel):
        gran = "channel" if g.axis == 0 else f"axis{g.axis}"
    else:
        gran = "tensor"
    words = ["asym"] if spec.scheme is Scheme.ASYM else []
    words += [spec.dtype.value, gran]
    return " ".join(words + (["mse"] if spec.range_method is RangeMethod.MSE else []))


def parse_spec_label(text: str) -> QSpec:
    """'int4 g128 mse' -> sym int4, groups of 128, mse. Words in any order, each kind at most
    once: sym|asym, the dtype (required), tensor|channel|axisN|gN, minmax|mse; unnamed fields
    are QSpec's defaults; or a GGUF type alone ('Q4_K', any case). ValueError otherwise."""
    words = text.split()
    if any(is_gguf_name(w) for w in words):
        if len(words) > 1:
            raise ValueError(f"'{text}': a GGUF type fixes its block layout; name it alone")
        return gguf_spec(words[0])
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
    return patch.apply(QSpec())


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
