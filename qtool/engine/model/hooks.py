"""Forward hooks held while a context is open: the one place eval's per-layer probe and
calibration's importance-matrix probe register and remove them."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self


class Hooks:
    """A context manager holding hooks: `_attach()` registers them on enter and returns their
    handles; exit removes every one, whatever ended the context."""

    _handles: list[Any]

    def _attach(self) -> list[Any]:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._handles = self._attach()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
