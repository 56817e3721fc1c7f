"""Imports run with SIGINT and SIGTERM blocked: a signal that arrives during one is delivered
as soon as it ends, where app.py's handler raises at an ordinary line of qtool. Raised inside
an import, the handler's exception was lost where a C extension's initialisation swallows it
(torch's: the run went on, wrote its output and exited 0), or it left a lazily loaded module
half executed (lazy.py: the error line's own printer missing, a traceback instead)."""

from __future__ import annotations

import builtins
import importlib.abc
import signal
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, TypeVar

_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_F = TypeVar("_F", bound=Callable[..., Any])


def deferring_signals(call: _F) -> _F:
    """`call`, with the signals blocked while it runs (the mask as it was restored after, so a
    nested call leaves them blocked and the outermost delivers what arrived)."""

    def deferred(*args: Any, **kwargs: Any) -> Any:
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            return call(*args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    return deferred  # type: ignore[return-value]


def defer_signals_in_imports() -> None:
    """Every `import` statement from now on defers the signals (once per process)."""
    if not getattr(builtins.__import__, "_qtool_deferred", False):
        deferred = deferring_signals(builtins.__import__)
        deferred._qtool_deferred = True  # type: ignore[attr-defined]
        builtins.__import__ = deferred


class DeferringLoader(importlib.abc.Loader):
    """A loader whose module runs with the signals deferred (what LazyLoader wraps: a lazy
    module runs on its first use, not through an import statement)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        created: ModuleType | None = self._loader.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        deferring_signals(self._loader.exec_module)(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package...: the loader's own
        return getattr(self._loader, name)
