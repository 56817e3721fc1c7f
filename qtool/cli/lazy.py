"""The layers the commands call, loaded on first use (importlib's LazyLoader): `qtool --help`
and usage errors never pay for torch, the engine or Rich."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import TYPE_CHECKING

from qtool.cli.deferred import DeferringLoader


def lazy_module(name: str) -> ModuleType:
    """The module `name`, executed on its first attribute access."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None
    spec.loader = importlib.util.LazyLoader(DeferringLoader(spec.loader))  # cli/deferred.py
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING:
    from qtool import api
    from qtool.report import console as report
    from qtool.report import json as documents
else:
    api = lazy_module("qtool.api")
    report = lazy_module("qtool.report.console")
    documents = lazy_module("qtool.report.json")

__all__ = ["api", "documents", "lazy_module", "report"]
