"""The error budget's chosen quantizations, kept from the choosing pass to the writing pass so
that each tensor is read from the input once.

The output's header lists every stored dtype and shape before its first byte, and the budget's
choices decide them, so the choices are made in a first pass over the tensors the budget decides
and written in a second. Their codes and qparams wait in an anonymous temporary file beside the
output (the file system the output goes to; unlinked at once, so nothing is left behind even
when the process is killed); only their error figures stay in memory. A dry run keeps the
figures alone.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from qtool.errors import OutputError
from qtool.io.atomic import describe_os_error
from qtool.io.checkpoint import tensor_bytes
from qtool.numerics.kernels import QuantizedTensor
from qtool.results import ErrorStats
from qtool.spec import QSpec

_PARTS = ("q", "scale", "zero_point", "choice")


@dataclass(frozen=True)
class _Part:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Figures:
    """What a table row shows of a quantization: its error figures and scale range."""

    errors: ErrorStats | None
    scale_range: tuple[float, float]


@dataclass(frozen=True)
class _Stored:
    spec: QSpec
    parts: dict[str, _Part]
    figures: Figures


class Spill:
    """Quantized tensors by name, each with the spec it was quantized with."""

    def __init__(self, directory: Path | None) -> None:
        """`directory`: where the temporary file goes; None keeps the figures alone."""
        self._directory = directory
        self._file: BinaryIO | None = None
        self._stored: dict[str, _Stored] = {}

    def put(self, name: str, spec: QSpec, result: QuantizedTensor) -> None:
        """Keep `result` (copied out: its codes may live in a reused workspace)."""
        parts = {}
        if self._directory is not None:
            for part in _PARTS:
                t = getattr(result, part)
                if t is not None:
                    parts[part] = self._append(t.cpu())
        scale_range = (float(result.scale.min()), float(result.scale.max()))
        self._stored[name] = _Stored(spec, parts, Figures(result.errors, scale_range))

    def figures(self, name: str, spec: QSpec) -> Figures | None:
        """The figures kept for `name` if it was quantized with `spec`."""
        stored = self._stored.get(name)
        return stored.figures if stored is not None and stored.spec == spec else None

    def take(self, name: str, spec: QSpec) -> QuantizedTensor | None:
        """The result kept for `name` if it was quantized with `spec` (None otherwise, e.g. a
        fused sibling aligned to another spec, which is quantized again), then forgets it."""
        stored = self._stored.pop(name, None)
        if stored is None or stored.spec != spec or not stored.parts:
            return None
        t = {part: self._read(p) for part, p in stored.parts.items()}
        errors = stored.figures.errors
        return QuantizedTensor(t["q"], t["scale"], t["zero_point"], errors, t.get("choice"))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._stored.clear()

    def _append(self, t: torch.Tensor) -> _Part:
        assert self._directory is not None
        f = self._open()
        offset = f.seek(0, 2)
        try:
            f.write(tensor_bytes(t))
        except OSError as err:
            raise OutputError(
                self._directory, f"cannot keep the budget's choices: {describe_os_error(err)}"
            ) from None
        return _Part(offset, t.dtype, tuple(t.shape))

    def _read(self, part: _Part) -> torch.Tensor:
        f = self._open()
        f.seek(part.offset)
        out = torch.empty(part.shape, dtype=part.dtype)
        view = tensor_bytes(out)
        if f.readinto(view) != len(view):  # type: ignore[attr-defined]
            raise OutputError(self._directory, "the budget's temporary file was cut short")
        return out

    def _open(self) -> BinaryIO:
        assert self._directory is not None
        if self._file is None:
            try:
                # closed by close(), which the run calls when it ends, however it ends
                self._file = tempfile.TemporaryFile(  # noqa: SIM115
                    dir=self._directory, prefix=".qtool-spill-"
                )
            except OSError as err:
                raise OutputError(
                    self._directory, f"cannot keep the budget's choices: {describe_os_error(err)}"
                ) from None
        return self._file
