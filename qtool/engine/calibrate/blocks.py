"""The pieces of the block-by-block pass (engine/calibrate/sequential.py): the model built empty
(meta device), its embeddings loaded and run, then each decoder block loaded from the
checkpoint, run on the activations at its input, and freed. Peak memory: the embeddings or one
block's weights (float32), the activations at one block boundary (windows x ctx x hidden
float32), the statistics.

The blocks are called with what the model's own forward gives them: the base model's forward
runs once per window with every block replaced by a recorder that keeps the block's arguments
(attention mask, rotary embeddings, position ids: whatever that architecture builds, per block)
and passes the hidden states on; the last recorder stops the forward (the final norm and the
head never run: llama-imatrix collects the blocks' matrices only, output.weight only with
--process-output)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from typing import Any

import torch

from qtool.engine.model.experts import router_name, stacked_experts
from qtool.errors import InputError, NumericError
from qtool.formats.base import FloatReader


class _Stop(Exception):
    """Raised by the last recorder: everything after the blocks is not needed."""


class _Recorder(torch.nn.Module):
    """Stands in for block `index` while the base model's forward runs: keeps the block's
    keyword arguments (from the first window; every window has the same length) and, for the
    first block, its input hidden states."""

    def __init__(self, block: torch.nn.Module, index: int, last: bool, pass_: _Capture) -> None:
        super().__init__()
        object.__setattr__(self, "_block", block)  # not a submodule: stays out of state dicts
        self.index, self.last, self.pass_ = index, last, pass_

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_block"), name)  # attention_type ...

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            raise TypeError("decoder blocks are called with their hidden states only")
        if self.index not in self.pass_.kwargs:
            self.pass_.kwargs[self.index] = kwargs
        if self.index == 0:
            self.pass_.keep(hidden.detach())
        if self.last:
            raise _Stop
        return hidden


class _Capture:
    def __init__(self, into: list[torch.Tensor] | None) -> None:
        self.kwargs: dict[int, dict[str, Any]] = {}
        self.hidden: list[torch.Tensor] = []
        self.into = into

    def keep(self, hidden: torch.Tensor) -> None:
        """A float32 copy of the first block's input, or copied into the next of `into`."""
        if self.into is None:
            self.hidden.append(hidden.float())
        else:
            self.hidden.append(self.into[len(self.hidden)].copy_(hidden))


def block_list(model: Any, path: Any) -> tuple[Any, torch.nn.ModuleList, str]:
    """(base model, its decoder blocks, the blocks' name in the state dict)."""
    base = getattr(model, getattr(model, "base_model_prefix", "") or "model", None)
    layers = getattr(base, "layers", None)
    if base is None or not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise InputError(
            path, f"{type(model).__name__} has no decoder blocks qtool can run one at a time "
            "(model.layers); calibrate supports the Llama family",
        )  # fmt: skip
    name = next(n for n, m in model.named_modules() if m is layers)
    return base, layers, name


def load_module(
    module: torch.nn.Module,
    prefix: str,
    reader: FloatReader,
    device: torch.device,
    path: Any,
    finite: bool = True,
) -> None:
    """The meta `module`'s parameters and persistent buffers read from the checkpoint (float32,
    onto `device`) under `prefix`; InputError naming a tensor the checkpoint lacks, one of
    another shape, or a non-persistent buffer qtool cannot rebuild; with `finite`, NumericError
    naming one holding NaN or infinite values (a method run with --keep-nonfinite loads them)."""
    names = set(reader.names)
    state: dict[str, torch.Tensor] = {}
    for local, meta in module.state_dict().items():
        name = f"{prefix}{local}"
        stored = name if name in names else router_name(name, names)
        if stored is not None:
            state[local] = _finite(_float32(reader, stored, device), stored, path, finite)
            continue
        stacked = stacked_experts(name, tuple(meta.shape), names)  # MoE Linears stored apart
        if stacked is None:
            raise InputError(path, "the checkpoint lacks this weight, which the model needs", name)
        state[local] = torch.empty(meta.shape, dtype=torch.float32, device=device)
        for e, parts in enumerate(stacked):
            linears = [_finite(_float32(reader, n, device), n, path, finite) for n in parts]
            cols = meta.shape[2:]
            if any(t.dim() != meta.dim() - 1 or t.shape[1:] != cols for t in linears):
                raise InputError(
                    path, f"expert {e}'s Linears ({', '.join(parts)}) are of shapes "
                    f"{', '.join(str(list(t.shape)) for t in linears)}, where config.json's "
                    f"sizes make [rows, {', '.join(map(str, cols))}]", parts[0],
                )  # fmt: skip
            matrix = torch.cat(linears, dim=0)
            if matrix.shape != meta.shape[1:]:
                raise InputError(
                    path, f"expert {e}'s Linears ({', '.join(parts)}) make a matrix of "
                    f"{list(matrix.shape)}, where config.json's sizes make "
                    f"{list(meta.shape[1:])}", parts[0],
                )  # fmt: skip
            state[local][e].copy_(matrix)
    module.load_state_dict(state, strict=True, assign=True)
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise InputError(
            path, f"{prefix}{left[0]} is computed, not stored, and qtool cannot rebuild it one "
            "block at a time; calibrate supports the Llama family",
        )  # fmt: skip


def _finite(values: torch.Tensor, name: str, path: Any, check: bool) -> torch.Tensor:
    """`values`, NumericError naming tensor `name` if any is NaN or infinite: the pass runs
    every window through the block, so one such weight makes its outputs, and every statistic
    after it, NaN (an expert's: the rows routed to it). Checked by its least and greatest value
    (NaN and +-Inf carry through both), counted only to say how many: a count over the whole
    tensor made a boolean and an int64 copy of it (SmolLM2's embeddings: +248 MiB at the peak)."""
    if not check:
        return values
    lo, hi = torch.aminmax(values)
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return values
    bad = int(values.numel() - torch.isfinite(values).sum())
    if bad:
        raise NumericError(
            path, f"has {bad:,} NaN/Inf values (as float32), through which no activation "
            "can be measured; fix the checkpoint", name,
        )  # fmt: skip
    return values


def _float32(reader: FloatReader, name: str, device: torch.device) -> torch.Tensor:
    stored = reader.values(name)  # as stored: one float32 copy made from it, on device
    out = stored.to(device=device, dtype=torch.float32, copy=True)
    del stored
    reader.release(name)
    return out


def prepare_base(
    base: Any, layers_name: str, reader: FloatReader, device: torch.device, path: Any
) -> None:
    """Everything of the base model but its blocks onto `device`: stored modules (embeddings,
    final norm) from the checkpoint; modules holding only computed buffers (the rotary
    embedding) built again from the config on the device."""
    prefix = layers_name.rsplit(".", 1)[0] + "." if "." in layers_name else ""
    for name, child in base.named_children():
        if isinstance(child, torch.nn.ModuleList):
            continue
        if child.state_dict():
            load_module(child, f"{prefix}{name}.", reader, device, path)
        elif any(True for _ in child.buffers()):
            setattr(base, name, type(child)(config=base.config).to(device))


def capture(
    base: Any,
    layers: torch.nn.ModuleList,
    windows: list[list[int]],
    device: torch.device,
    into: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], dict[int, dict[str, Any]]]:
    """The hidden states entering the first block, per window (copied into `into`'s tensors
    when given: one (1, ctx, hidden) float32 tensor per window), and each block's keyword
    arguments, from the base model's own forward."""
    blocks = list(layers)
    captured = _Capture(into)
    for i, block in enumerate(blocks):
        layers[i] = _Recorder(block, i, i == len(blocks) - 1, captured)
    try:
        with torch.no_grad():
            for window in windows:
                ids = torch.tensor([window], dtype=torch.long, device=device)
                with contextlib.suppress(_Stop):
                    base(input_ids=ids, use_cache=False)
    finally:
        for i, block in enumerate(blocks):
            layers[i] = block
    return captured.hidden, captured.kwargs


def return_freed_memory() -> None:
    """Give the freed block's pages back to the system (glibc's malloc_trim). Tensors under
    glibc's mmap threshold (dynamic, up to 32 MiB: every tensor of a small model) come from
    its heap, which keeps freed pages resident: without this, resident memory grew by about
    one block per block (tests/reliability/test_calibrate_memory.py)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        pass
