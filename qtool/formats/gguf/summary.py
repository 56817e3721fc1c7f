"""What `qtool inspect model.gguf` shows: the architecture and key metadata, every tensor with
its GGUF type, shape, bytes and bits per weight, and totals by type. From the header alone
(no tensor data is read), torch-free.

    summary = summarize(path, header)
    summary.rows[0]       TensorRow('token_embd.weight', 'Q6_K', (49152, 576), ...)
    summary.totals        [TypeTotal(dtype='Q4_K', tensors=..., numel=..., nbytes=...), ...]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qtool.errors import InputError
from qtool.formats.gguf.ftype import FILE_TYPE_KEY, ftype_name
from qtool.gguf_types import ValueType
from qtool.io.gguf_layout import GGUFHeader, GGUFValue
from qtool.results import TypeTotal

ARCH_KEY = "general.architecture"
SHOWN_KEYS = ("general.name", "general.basename", "general.size_label", "general.quantized_by")
SPLIT_NO, SPLIT_COUNT = "split.no", "split.count"
MAX_SHOWN_CHARS = 256  # of a metadata string: inspect shows a prefix and the whole length


def split_part(header: GGUFHeader) -> tuple[int, int] | None:
    """(part, parts), counting from 1, when the file is one part of a split GGUF
    (llama-gguf-split's split.no / split.count); None for a whole file."""
    no, count = _int(header.metadata.get(SPLIT_NO)), _int(header.metadata.get(SPLIT_COUNT))
    if (count is None or count <= 1) and not no:
        return None
    return (no or 0) + 1, count if count is not None else 0


def refuse_split(path: Path, header: GGUFHeader) -> None:
    """InputError for one part of a split GGUF: its tensors are only part of a model, and
    every command that reads tensors refuses it alike (inspect shows which part it is)."""
    part = split_part(header)
    if part is not None:
        of = f" of {part[1]}" if part[1] else ""
        raise InputError(
            path, f"part {part[0]}{of} of a split GGUF, not a whole model; merge the parts "
            "first (llama-gguf-split --merge FIRST-PART OUT.gguf)",
        )  # fmt: skip


@dataclass(frozen=True)
class TensorRow:
    """One tensor: `shape` in torch order (GGUF's reversed), bits per weight of its type."""

    name: str
    gguf_type: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.numel if self.numel else 0.0


@dataclass(frozen=True)
class GGUFSummary:
    """A GGUF file at a glance; None where the file does not say."""

    path: str
    version: int
    architecture: str | None
    name: str | None
    block_count: int | None
    context_length: int | None
    vocab_size: int | None
    file_type: int | None
    rows: list[TensorRow]
    metadata: dict[str, str] = field(default_factory=dict)  # the other key values shown
    n_metadata: int = 0  # key/value pairs in the file

    @property
    def file_type_name(self) -> str | None:
        return None if self.file_type is None else ftype_name(self.file_type)

    @property
    def totals(self) -> list[TypeTotal]:
        """Per GGUF type, most bytes first."""
        by: dict[str, list[TensorRow]] = {}
        for r in self.rows:
            by.setdefault(r.gguf_type, []).append(r)
        totals = [
            TypeTotal(t, len(rs), sum(r.numel for r in rs), sum(r.nbytes for r in rs))
            for t, rs in by.items()
        ]
        return sorted(totals, key=lambda t: -t.nbytes)

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    @property
    def total_numel(self) -> int:
        return sum(r.numel for r in self.rows)


def summarize(path: str, header: GGUFHeader) -> GGUFSummary:
    meta = header.metadata
    arch = _str(meta.get(ARCH_KEY))
    rows = [
        TensorRow(t.name, t.type.name, t.torch_shape, t.numel, t.nbytes) for t in header.tensors
    ]
    shown = {k: _show(meta[k]) for k in SHOWN_KEYS if k in meta}
    part = split_part(header)
    if part is not None:
        shown["split"] = f"part {part[0]} of {part[1] or '?'} (merge with llama-gguf-split --merge)"
    return GGUFSummary(
        path=path,
        version=header.version,
        architecture=_shorter(arch),
        name=_shorter(_str(meta.get("general.name"))),
        block_count=_int(meta.get(f"{arch}.block_count")),
        context_length=_int(meta.get(f"{arch}.context_length")),
        vocab_size=_vocab_size(meta, arch),
        file_type=_int(meta.get(FILE_TYPE_KEY)),
        rows=rows,
        metadata=shown,
        n_metadata=len(meta),
    )


def _vocab_size(meta: dict[str, GGUFValue], arch: str | None) -> int | None:
    """`{arch}.vocab_size`, else the length of the tokenizer's token list."""
    declared = _int(meta.get(f"{arch}.vocab_size"))
    if declared is not None:
        return declared
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and tokens.type is ValueType.ARRAY:
        return len(tokens.value)  # type: ignore[arg-type]
    return None


_INTS = (ValueType.UINT8, ValueType.INT8, ValueType.UINT16, ValueType.INT16, ValueType.UINT32,
         ValueType.INT32, ValueType.UINT64, ValueType.INT64)  # fmt: skip


def _int(v: GGUFValue | None) -> int | None:
    return int(v.value) if v is not None and v.type in _INTS else None  # type: ignore[arg-type]


def _str(v: GGUFValue | None) -> str | None:
    return v.value if v is not None and isinstance(v.value, str) else None


def _show(v: GGUFValue) -> str:
    if v.type is ValueType.ARRAY:
        return f"[{len(v.value)} items]"  # type: ignore[arg-type]
    return _shorter(str(v.value)) or ""


def _shorter(text: str | None) -> str | None:
    """At most MAX_SHOWN_CHARS of `text`, saying how long it is when cut (a 5 MB name)."""
    if text is None or len(text) <= MAX_SHOWN_CHARS:
        return text
    return f"{text[:MAX_SHOWN_CHARS]}... ({len(text):,} characters)"
