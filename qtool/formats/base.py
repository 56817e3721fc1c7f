"""The seam every on-disk quantized format plugs into.

A format says what it can store (`supports`), which files one output shard occupies (`layout`),
takes the tensors of one shard from the quantize loop (`writer`), and gives any file it wrote
back as float tensors (`reader`, chosen by `detect`). The loop in engine/run.py knows nothing
else about it, so a second format (compressed-tensors) plugs in without touching the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from qtool.io.stformat import TensorEntry
from qtool.spec import QSpec

if TYPE_CHECKING:
    import torch

    from qtool.io.atomic import OutputSet
    from qtool.numerics.kernels import QuantizedTensor


class Planned(Protocol):
    """What a format needs of one tensor's plan: the tensor, and its spec (None: kept)."""

    @property
    def entry(self) -> TensorEntry: ...

    @property
    def spec(self) -> QSpec | None: ...


class ShardWriter(Protocol):
    """Receives the tensors of one shard, in `order`, then writes what remains and closes."""

    @property
    def order(self) -> Sequence[TensorEntry]:
        """The input tensors in the order the writer takes them."""

    def keep(self, entry: TensorEntry, data: memoryview) -> None:
        """A tensor stored as it is (its bytes as in the input)."""

    def quantized(self, entry: TensorEntry, spec: QSpec, result: QuantizedTensor) -> None:
        """A quantized tensor; its codes stay valid only until this call returns."""

    def finish(self) -> None:
        """Everything after the last tensor (qparams, a rewritten header)."""


class OutputFormat(Protocol):
    name: str

    def supports(self, entry: TensorEntry, spec: QSpec) -> str | None:
        """None when the format can store `entry` quantized with `spec`; else why not."""

    def layout(self, out: Path) -> list[Path]:
        """Every file one output shard named `out` occupies (checked before writing)."""

    def writer(
        self,
        planned: Sequence[Planned],
        metadata: dict[str, str] | None,
        out: Path,
        outputs: OutputSet,
    ) -> ShardWriter: ...


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

    def quantization(self, name: str) -> QSpec | None:
        """How the tensor was quantized; None when it is stored as it is."""

    def values(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor (dequantized to `dtype`, default its original dtype, if quantized)."""

    def raw(self, name: str) -> memoryview:
        """The stored bytes of a tensor that is not quantized."""

    def nbytes(self, name: str) -> int:
        """Bytes the tensor takes as stored (its codes, for a quantized tensor)."""

    def stored_dtype(self, name: str) -> str:
        """The dtype as stored (the codes' dtype, for a quantized tensor)."""

    def release(self, name: str) -> None:
        """Drop the pages of a tensor already consumed."""

    def check_unchanged(self) -> None: ...

    def close(self) -> None: ...
