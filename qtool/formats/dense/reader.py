"""Reading plain float checkpoints through the same interface as quantized files (nothing is
quantized), and any directory's weight files, each read by its format's reader, as one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from qtool.formats.base import FloatReader
from qtool.formats.detect import Detected
from qtool.io.checkpoint import Checkpoint, open_checkpoint
from qtool.spec import Codec


class DenseReader:
    """One float checkpoint file (a FloatReader)."""

    def __init__(self, path: Path, ckpt: Checkpoint | None = None) -> None:
        self.path = path
        self.ckpt = ckpt or open_checkpoint(path)
        self._entries = self.ckpt.by_name()

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.ckpt.entries]

    @property
    def metadata(self) -> dict[str, str] | None:
        return self.ckpt.metadata

    def quantization(self, name: str) -> Codec | None:
        return None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> str:
        return self._entries[name].dtype

    def values(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.ckpt.tensor(self._entries[name])
        return t if dtype is None else t.to(dtype)

    def raw(self, name: str) -> memoryview:
        return self.ckpt.raw(self._entries[name])

    def nbytes(self, name: str) -> int:
        return self._entries[name].nbytes

    def stored_dtype(self, name: str) -> str:
        return self._entries[name].dtype

    def release(self, name: str) -> None:
        self.ckpt.release(self._entries[name])

    def check_unchanged(self) -> None:
        self.ckpt.check_unchanged()

    def file_of(self, name: str) -> Path:
        return self.path

    @property
    def sidecars(self) -> list[Path]:
        return []

    def restored_files(self) -> dict[str, bytes]:
        return {}

    def close(self) -> None:
        self.ckpt.close()


class ShardedReader:
    """A directory's weight files, each opened by `open_one` (all of them checked before any
    is read), as one FloatReader; a name is read from the file that holds it. `restored`: the
    directory's files a float directory gets rewritten (config.json), by name."""

    def __init__(
        self,
        found: Detected,
        open_one: Callable[[Path], FloatReader],
        restored: dict[str, bytes] | None = None,
    ) -> None:
        self.path = found.named
        self._restored = restored or {}
        self.parts: list[FloatReader] = []
        try:
            for weights in found.weights:
                self.parts.append(open_one(weights))
        except BaseException:
            self.close()
            raise
        self._by_name = {n: part for part in self.parts for n in part.names}

    @property
    def names(self) -> list[str]:
        return [n for part in self.parts for n in part.names]

    @property
    def metadata(self) -> dict[str, str] | None:
        return self.parts[0].metadata if self.parts else None

    def quantization(self, name: str) -> Codec | None:
        return self._by_name[name].quantization(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._by_name[name].shape(name)

    def dtype(self, name: str) -> str:
        return self._by_name[name].dtype(name)

    def values(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._by_name[name].values(name, dtype)

    def raw(self, name: str) -> memoryview:
        return self._by_name[name].raw(name)

    def nbytes(self, name: str) -> int:
        return self._by_name[name].nbytes(name)

    def stored_dtype(self, name: str) -> str:
        return self._by_name[name].stored_dtype(name)

    def file_of(self, name: str) -> Path:
        return self._by_name[name].file_of(name)

    @property
    def sidecars(self) -> list[Path]:
        return [s for part in self.parts for s in part.sidecars]

    def restored_files(self) -> dict[str, bytes]:
        return dict(self._restored)

    def release(self, name: str) -> None:
        self._by_name[name].release(name)

    def check_unchanged(self) -> None:
        for part in self.parts:
            part.check_unchanged()

    def close(self) -> None:
        for part in self.parts:
            part.close()
