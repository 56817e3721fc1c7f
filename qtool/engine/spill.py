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

import contextlib
import os
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
from qtool.spec import Codec

_PARTS = ("q", "scale", "zero_point", "choice")


_WHAT = "the calibrated method's codes or the budget's choices until they are written"


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
    spec: Codec
    parts: dict[str, _Part]
    figures: Figures
    method: str | None = None


class Spill:
    """Quantized tensors by name, each with the spec it was quantized with (the error budget's
    choices, or a calibrated method's codes: engine/methods)."""

    def __init__(self, directory: Path | None) -> None:
        """`directory`: where the temporary file goes; None keeps the figures alone."""
        self._directory = directory
        self._file: BinaryIO | None = None
        self._end = 0  # where the next part goes
        self._stored: dict[str, _Stored] = {}
        self._floats: dict[str, _Part] = {}

    @property
    def directory(self) -> Path | None:
        """Where its temporary file goes (None: a dry run's, which keeps the figures alone)."""
        return self._directory

    def put(self, name: str, spec: Codec, result: QuantizedTensor) -> None:
        """Keep `result` (copied out: its codes may live in a reused workspace)."""
        parts = {}
        if self._directory is not None:
            for part in _PARTS:
                t = getattr(result, part)
                if t is not None:
                    parts[part] = self._append(t.cpu())
        scale_range = (float(result.scale.min()), float(result.scale.max()))
        figures = Figures(result.errors, scale_range)
        self._stored[name] = _Stored(spec, parts, figures, result.method)

    def put_float(self, name: str, values: torch.Tensor) -> None:
        """Keep new values of a tensor the output stores float (a calibrated method changed
        them: AWQ's scales folded into a norm), in the temporary file like the codes."""
        if self._directory is not None:
            self._floats[name] = self._append(values.detach().cpu().contiguous())

    def take_float(self, name: str) -> torch.Tensor | None:
        """The new values kept for `name` (None: the input's stand), then forgets them."""
        part = self._floats.pop(name, None)
        return self._read(part) if part is not None else None

    def figures(self, name: str, spec: Codec) -> Figures | None:
        """The figures kept for `name` if it was quantized with `spec`."""
        stored = self._stored.get(name)
        return stored.figures if stored is not None and stored.spec == spec else None

    def take(self, name: str, spec: Codec) -> QuantizedTensor | None:
        """The result kept for `name` if it was quantized with `spec` (None otherwise, e.g. a
        fused sibling aligned to another spec, which is quantized again), then forgets it."""
        stored = self._stored.pop(name, None)
        if stored is None or stored.spec != spec or not stored.parts:
            return None
        t = {part: self._read(p) for part, p in stored.parts.items()}
        errors = stored.figures.errors
        choice = t.get("choice")
        return QuantizedTensor(t["q"], t["scale"], t["zero_point"], errors, choice, stored.method)

    def close(self) -> None:
        """Drop the temporary file (unbuffered: closing cannot fail on unwritten data)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        self._stored.clear()
        self._floats.clear()

    def _append(self, t: torch.Tensor) -> _Part:
        fd, offset = self._open().fileno(), self._end
        data = tensor_bytes(t)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], offset + done)
        except OSError as err:
            raise self._error(err) from None
        self._end += len(data)
        return _Part(offset, t.dtype, tuple(t.shape))

    def _read(self, part: _Part) -> torch.Tensor:
        fd = self._open().fileno()
        out = torch.empty(part.shape, dtype=part.dtype)
        view, done = tensor_bytes(out), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], part.offset + done)
            if n == 0:
                raise OutputError(self._where(), f"the temporary file of {_WHAT} was cut short")
            done += n
        return out

    def _open(self) -> BinaryIO:
        assert self._directory is not None
        if self._file is None:
            try:
                # closed by close(), which the run calls when it ends, however it ends
                self._file = tempfile.TemporaryFile(  # noqa: SIM115
                    buffering=0, dir=self._directory, prefix=".qtool-spill-"
                )
            except OSError as err:
                raise self._error(err) from None
        return self._file

    def _where(self) -> Path:
        """The output's directory, absolute (a relative -o's is '.', which says nothing)."""
        assert self._directory is not None
        return self._directory.absolute()

    def _error(self, err: OSError) -> OutputError:
        return OutputError(self._where(), f"cannot keep {_WHAT}: {describe_os_error(err)}")
