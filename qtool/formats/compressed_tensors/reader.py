"""A compressed-tensors model directory as float tensors: every shard (by its index, or the one
weight file) behind one FloatReader, each quantized module dequantized on the fly under its float
name (`P.weight`), whoever wrote it."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from qtool.errors import InputError
from qtool.formats.compressed_tensors.codec import dequantize_named
from qtool.formats.compressed_tensors.config import read_config
from qtool.formats.compressed_tensors.schemes import (
    COMPONENTS,
    CtModule,
    args_spec,
    restore_plan,
)
from qtool.formats.detect import Detected
from qtool.io.checkpoint import Checkpoint, open_checkpoint
from qtool.io.stformat import TensorEntry
from qtool.spec import QSpec

QUANTIZATION_KEYS = ("quantization_config", "compression_config")


class ModelReader:
    """A model directory's tensors by their float names (FloatReader)."""

    def __init__(self, found: Detected) -> None:
        assert found.directory is not None and found.config_path is not None
        self.path = found.directory
        self.within = found.within  # every file below is read through this descriptor
        self._config_doc = found.config
        config_file = found.config_path
        config = read_config(found.config, config_file)
        self._ckpts: list[Checkpoint] = []
        self.shard_paths = list(found.weights)
        try:
            for shard in self.shard_paths:
                self._ckpts.append(open_checkpoint(shard, self.within))
        except BaseException:
            self.close()
            raise
        self._where = {e.name: (c, e) for c in self._ckpts for e in c.entries}
        stored = [e.name for c in self._ckpts for e in c.entries]
        try:
            plan = restore_plan(stored, config)
        except ValueError as err:
            self.close()
            raise InputError(config_file, str(err)) from None
        self._modules: dict[str, CtModule] = {n: m for n, m in plan if m is not None}
        self._names = [n for n, _ in plan]
        self._stored = _by_module(stored, self._modules.values())
        self._shapes: dict[str, tuple[int, ...]] = {}

    @property
    def names(self) -> list[str]:
        return self._names

    @property
    def metadata(self) -> dict[str, str] | None:
        return self._ckpts[0].metadata if self._ckpts else None

    def _components(self, name: str) -> dict[str, str]:
        module = self._modules[name]
        local = module.tensor_names(self._stored.get(module.module, ()))
        return {k: v for k, v in local.items() if k in COMPONENTS}

    def _entry(self, stored: str) -> TensorEntry:
        return self._where[stored][1]

    def _read(self, stored: str) -> torch.Tensor:
        ckpt, entry = self._where[stored]
        return ckpt.tensor(entry)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._modules:
            return self._entry(name).shape
        if name not in self._shapes:
            parts = self._components(name)
            if "weight" in parts:
                self._shapes[name] = self._entry(parts["weight"]).shape
            else:
                shape = self._read(parts["weight_shape"]) if "weight_shape" in parts else None
                if shape is None or shape.numel() != 2:
                    raise InputError(self.path, "weight_shape missing or not [N, K]", name)
                self._shapes[name] = (int(shape[0]), int(shape[1]))
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        if name not in self._modules:
            return self._entry(name).dtype
        parts = self._components(name)
        if "weight_scale" not in parts:
            raise InputError(self.path, "quantized module without weight_scale", name)
        return self._entry(parts["weight_scale"]).dtype

    def quantization(self, name: str) -> QSpec | None:
        module = self._modules.get(name)
        return args_spec(module.group.weights) if module is not None else None

    def scheme(self, name: str) -> str | None:
        """compressed-tensors' own description ('sym int4 group 128'), None when not quantized."""
        module = self._modules.get(name)
        return module.group.weights.describe() if module is not None else None

    def values(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self._modules:
            t = self._read(name)
        else:
            try:
                module = self._modules[name]
                t = dequantize_named(module, self._read, self._stored.get(module.module, ()))
            except ValueError as err:
                raise InputError(self.path, str(err), name) from None
        return t if dtype is None else t.to(dtype)

    def raw(self, name: str) -> memoryview:
        ckpt, entry = self._where[name]
        return ckpt.raw(entry)

    def nbytes(self, name: str) -> int:
        if name not in self._modules:
            return self._entry(name).nbytes
        return sum(self._entry(s).nbytes for s in self._components(name).values())

    def stored_dtype(self, name: str) -> str:
        if name not in self._modules:
            return self._entry(name).dtype
        parts = self._components(name)
        return self._entry(parts.get("weight_packed", parts.get("weight", ""))).dtype

    def file_of(self, name: str) -> Path:
        """The shard of the tensor (a quantized module's: that of its first tensor)."""
        first = next(iter(self._components(name).values())) if name in self._modules else name
        return self._where[first][0].path

    @property
    def sidecars(self) -> list[Path]:
        return []

    def restored_files(self) -> dict[str, bytes]:
        """config.json without its quantization_config: the float model's."""
        assert isinstance(self._config_doc, dict)
        doc = {k: v for k, v in self._config_doc.items() if k not in QUANTIZATION_KEYS}
        return {"config.json": (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()}

    def release(self, name: str) -> None:
        stored = self._components(name).values() if name in self._modules else [name]
        for s in stored:
            ckpt, entry = self._where[s]
            ckpt.release(entry)

    def check_unchanged(self) -> None:
        for ckpt in self._ckpts:
            ckpt.check_unchanged()

    def close(self) -> None:
        for ckpt in self._ckpts:
            ckpt.close()


def _by_module(stored: list[str], modules: Iterable[CtModule]) -> dict[str, list[str]]:
    """The stored names of each quantized module, by module name, found in one pass: looking
    them up among every name per module made a read of N modules cost N^2 (issue 33)."""
    wanted = {m.module for m in modules}
    own: dict[str, list[str]] = {}
    for name in stored:
        head = name.rpartition(".")[0]
        if head in wanted:
            own.setdefault(head, []).append(name)
    return own
