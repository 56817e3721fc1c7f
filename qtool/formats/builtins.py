"""The formats qtool ships, loaded (and so registered) on first use. A new format package adds
its module name here; nothing else in qtool names it (engine and CLI ask the registry)."""

from __future__ import annotations

import importlib

BUILTIN = (
    "qtool.formats.dense",
    "qtool.formats.qtool",
    "qtool.formats.compressed_tensors",
    "qtool.formats.gguf",
    "qtool.formats.eval_logits",
)


def load() -> None:
    """Import every built-in format package (each registers itself on import)."""
    for name in BUILTIN:
        importlib.import_module(name)
