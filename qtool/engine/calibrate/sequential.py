"""The block-by-block pass of a calibrated method (engine/methods) and of calibrate's importance
matrix (run_blocks): the model built empty, its embeddings run once on every stream's windows,
then for each decoder block in turn: loaded from the checkpoint, run on each stream with the
method's probe (pass 1: statistics), quantized by the method (the block's weights replaced by
what a consumer will reconstruct), run again on each stream (pass 2: its QUANTIZED outputs
become the next block's inputs, so the error of every block before propagates), and freed. A
method that keeps the weights (the importance matrix: statistics only) has no pass 2: pass 1's
outputs go on. Peak memory: one block's weights (float32), the method's statistics for one
block, the activations at one block boundary (in a temporary file, mapped, past
ACTIVATIONS_IN_MEMORY)."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from qtool.engine.calibrate.blocks import (
    block_list,
    capture,
    load_module,
    prepare_base,
    return_freed_memory,
)
from qtool.engine.imatrix_hooks import ImatrixProbe
from qtool.errors import OutputError
from qtool.formats.base import FloatReader
from qtool.io.atomic import describe_os_error
from qtool.numerics.imatrix import MatrixStats
from qtool.results import Progress

ACTIVATIONS_IN_MEMORY = 2 << 30
"""The activations at a block boundary (windows x ctx x hidden float32) held in memory on the
CPU; past it they are spilled to a temporary file beside the output (spilled())."""


class Enough(Exception):
    """Raised by a probe's hook in pass 1 once the window gave it everything it gathers: the
    rest of the block's forward, whose outputs pass 1 drops, is skipped (GPTQ's Hessians: the
    down projection's product, about a fifth of a Llama block's work)."""


class Probe(AbstractContextManager[Any], Protocol):
    stream: str


class BlockMethod(Protocol):
    """What the pass asks of a method: a probe for pass 1 on block `prefix` (its hooks held
    while the context is open; `stream` says which stream runs), then the block's
    quantization from what the probe gathered (weights replaced in place)."""

    def probe(self, block: torch.nn.Module, prefix: str) -> Probe: ...

    def quantize(self, prefix: str, probe: Any) -> None: ...


class Tracker(Protocol):
    """More streams carried through the same block loads (engine/methods/verdict.py): `start`
    with the activations entering the first block, `before` with each block as loaded,
    `after` once the method's outputs have run (`reload` reads the block again). `carried`: the
    streams whose chosen activations it reads after the last block (the others' last pass 2
    is skipped)."""

    @property
    def carried(self) -> Collection[str]: ...

    def start(self, streams: Mapping[str, Sequence[torch.Tensor]]) -> None: ...

    def before(self, block: torch.nn.Module, kwargs: dict[str, Any]) -> None: ...

    def after(
        self,
        block: torch.nn.Module,
        prefix: str,
        kwargs: dict[str, Any],
        reload: Callable[[], None],
    ) -> None: ...


def run_sequential(
    model: Any,
    reader: FloatReader,
    streams: Mapping[str, Sequence[list[int]]],
    method: BlockMethod,
    device: torch.device,
    path: Any,
    progress: Progress | None = None,
    bound: int | None = None,
    directory: Path | None = None,
    tracker: Tracker | None = None,
    keeps_weights: bool = False,
    finite: bool = True,
) -> None:
    """Every decoder block of `model`, in order, through `method` on the windows of each stream
    (name -> windows of token ids, all of one length); activations over `bound` bytes (None:
    ACTIVATIONS_IN_MEMORY) on the CPU spilled to a temporary file in `directory` (spilled()).
    `keeps_weights`: the method changes no weight, so pass 1's outputs go on (no pass 2).
    `finite`: a weight holding NaN/Inf is refused as its block loads (load_module)."""
    base, layers, layers_name = block_list(model, path)
    prepare_base(base, layers_name, reader, device, path)
    windows = [w for ws in streams.values() for w in ws]
    width = int(model.config.hidden_size)
    limit = ACTIVATIONS_IN_MEMORY if bound is None else bound
    into = spilled(len(windows), len(windows[0]), width, device, limit, directory)
    hidden, kwargs = capture(base, layers, windows, device, into)
    for _, child in base.named_children():  # the embeddings are done with
        if not isinstance(child, torch.nn.ModuleList):
            child.to_empty(device="meta")
    named: dict[str, list[torch.Tensor]] = {}
    start = 0
    for name, ws in streams.items():
        named[name] = hidden[start : start + len(ws)]
        start += len(ws)
    if tracker is not None:
        tracker.start(named)
    for i, block in enumerate(layers):
        prefix = f"{layers_name}.{i}."
        load_module(block, prefix, reader, device, path, finite)
        if tracker is not None:
            tracker.before(block, kwargs[i])
        with torch.no_grad():
            with method.probe(block, prefix) as probe:
                for name, xs in named.items():
                    probe.stream = name
                    for x in xs:
                        if keeps_weights:  # in place: long-lived buffers stay put
                            x.copy_(block(x, **kwargs[i]))
                        else:
                            with contextlib.suppress(Enough):
                                block(x, **kwargs[i])
                        _advance(progress, f"block {i}", x)
            method.quantize(prefix, probe)
            del probe  # its statistics are spent: not alive through pass 2 and the next load
            if not keeps_weights:
                last = i == len(layers) - 1  # no block after it: only what the tracker reads
                wanted = set(named) if not last else set(tracker.carried) if tracker else set()
                for xs in (xs for name, xs in named.items() if name in wanted):
                    for x in xs:
                        x.copy_(block(x, **kwargs[i]))
                        _advance(progress, f"block {i}", x)
        if tracker is not None:
            tracker.after(block, prefix, kwargs[i], partial(load_module, block, prefix, reader,
                                                            device, path, finite))  # fmt: skip
        block.to_empty(device="meta")
        return_freed_memory()


class _Importance:
    """calibrate's importance matrix as a method of the pass: pass 1 sums each Linear's squared
    inputs (engine/imatrix_hooks.py); the weights stay as they are."""

    def __init__(self) -> None:
        self.stats: dict[str, MatrixStats] = {}

    def probe(self, block: torch.nn.Module, prefix: str) -> Any:
        return ImatrixProbe(block)

    def quantize(self, prefix: str, probe: ImatrixProbe) -> None:
        self.stats |= {f"{prefix}{n}": s for n, s in probe.stats().items()}


def run_blocks(
    model: Any,
    reader: FloatReader,
    windows: list[list[int]],
    device: torch.device,
    path: Any,
    progress: Progress | None = None,
) -> dict[str, MatrixStats]:
    """The statistics of every Linear of every decoder block over `windows`, keyed by the
    checkpoint's names; the activations stay in memory (calibrate's --tokens bounds them)."""
    importance = _Importance()
    run_sequential(model, reader, {"calibration": windows}, importance, device, path, progress,
                   bound=sys.maxsize, keeps_weights=True)  # fmt: skip
    return importance.stats


def spilled(
    windows: int, ctx: int, width: int, device: torch.device, bound: int, directory: Path | None
) -> list[torch.Tensor] | None:
    """Where the activations at a block boundary live when they exceed `bound` bytes on the
    CPU: one (1, ctx, width) float32 tensor per window, mapped from an anonymous temporary file
    in `directory` (unlinked at once: a killed run leaves nothing), so that the kernel pages
    them in and out as the windows run; None: in memory. On a GPU they stay in its memory (the
    caller bounds them)."""
    nbytes = windows * ctx * width * 4
    if nbytes <= bound or device.type != "cpu":
        return None
    try:
        with tempfile.TemporaryFile(dir=directory, prefix=".qtool-activations-") as f:
            f.truncate(nbytes)  # the map keeps its own descriptor: the file lives while it does
            _reserve(f.fileno(), nbytes)
            mapped = np.memmap(f, dtype=np.float32, mode="r+", shape=(windows, 1, ctx, width))
    except OSError as err:
        raise OutputError(directory, "cannot keep the activations of the calibration windows: "
                          f"{describe_os_error(err)}") from None  # fmt: skip
    return list(torch.from_numpy(mapped))


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate the file's blocks now: a mapped page the disk has no room for is a SIGBUS at
    its first touch (the process killed, no message), where posix_fallocate's ENOSPC is an
    error. Where a filesystem cannot reserve, glibc writes a byte per block instead (the same
    reservation, slower); the file stays sparse, with that risk, only without posix_fallocate
    (macOS, Windows) or where the C library passes the kernel's refusal on (musl: EOPNOTSUPP)."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:
        return
    try:
        fallocate(fd, 0, nbytes)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


def _advance(progress: Progress | None, what: str, x: torch.Tensor) -> None:
    if progress is not None:
        progress.advance(what, x.shape[-2])
