"""Replaying the part of a block that a search does not change: AWQ tries some 20 scale
candidates per balanced group, each a forward of the whole block on every fit window, though
only the group's Linears differ between them. Every module that runs, once, before the group's
first Linear (and is not one of the group's ancestors) computes the same output for each
candidate; the first forward records those outputs, and the later ones swap each such module for
a stub that returns its recorded output. The block then runs only from the group on, with the
same operations on the same values: the same bits as a whole forward (tests compare them).

Which modules qualify comes from the order the block's modules ran in on one forward (hooks), so
it follows the model's code rather than a list of names; the recorded outputs are bounded
(REPLAY_BYTES over the stream's windows), past which the stubs are narrowed to the block's own
children, or none are used."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

REPLAY_BYTES = 96 << 20
"""The most one group's records may hold over one stream's windows (SmolLM2 at 28 fit windows
of 512 records about 11 MB per window for its down projection's group: 310 MB, over this; the
block's own children, the attention's output and the norms', 3.5 MB per window). A group's
search records its fit windows, then its held-out and check windows while their records are
still kept: at most 3 x REPLAY_BYTES, dropped when the group is done."""


@dataclass(frozen=True)
class Ran:
    """One module's place in a forward: when it started and ended (event numbers), how many
    times it ran, and its output's size in bytes on its last call."""

    start: int
    end: int
    calls: int
    nbytes: int | None  # None: an output a stub cannot copy


@contextmanager
def execution(block: torch.nn.Module, found: dict[str, Ran]) -> Iterator[None]:
    """Fill `found` with every submodule of `block` (local names) that runs in the context."""
    clock = itertools.count()
    started: dict[str, int] = {}

    def before(name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            started.setdefault(name, next(clock))

        return hook

    def after(name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            calls = found[name].calls + 1 if name in found else 1
            found[name] = Ran(started[name], next(clock), calls, _nbytes(output))

        return hook

    handles = []
    for name, module in block.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(before(name)))
            handles.append(module.register_forward_hook(after(name)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def fixed_modules(
    block: torch.nn.Module, ran: dict[str, Ran], linears: Sequence[str], windows: int
) -> tuple[str, ...]:
    """The modules a search over `linears` may replay: each that ran once and ended before the
    first of them started, taken whole (its subtree), and none that holds one of them; the
    block's own children alone when the whole set's outputs over `windows` would pass
    REPLAY_BYTES, none when those would too."""
    if not all(n in ran for n in linears):
        return ()
    first = min(ran[n].start for n in linears)
    holders = {".".join(n.split(".")[:k]) for n in linears for k in range(1, n.count(".") + 1)}
    chosen: list[str] = []

    def walk(prefix: str, module: torch.nn.Module) -> None:
        for child, sub in module.named_children():
            name = f"{prefix}{child}"
            if name in holders:
                walk(f"{name}.", sub)
            elif name in ran and _fixed(ran[name], first):
                chosen.append(name)

    walk("", block)
    for candidate in (chosen, [n for n in chosen if "." not in n]):
        if sum(ran[n].nbytes or 0 for n in candidate) * windows <= REPLAY_BYTES:
            return tuple(candidate)
    return ()


def _fixed(ran: Ran, first: int) -> bool:
    return ran.calls == 1 and ran.end < first and ran.nbytes is not None


class Recorded:
    """The outputs of `names` (modules of `block`) on each window, recorded by one forward of
    the window (`record`) and replayed by `replaying` in its later ones. The tensors are the
    modules' own, not copies (a copy per call cost more than the replay saved); a forward that
    changes one in place (its version counter moves) ends the replay for good, so a changed
    record is never replayed."""

    def __init__(self, block: torch.nn.Module, names: Sequence[str]) -> None:
        self.block, self.names = block, tuple(names)
        self.outputs: dict[int, dict[str, Any]] = {}
        self.versions: dict[int, dict[str, list[int]]] = {}

    def has(self, window: int) -> bool:
        return window in self.outputs

    @contextmanager
    def record(self, window: int) -> Iterator[None]:
        """Keep the outputs of `window`'s forward."""
        kept: dict[str, Any] = {}
        versions: dict[str, list[int]] = {}
        modules = dict(self.block.named_modules())

        def keep(name: str) -> Callable[..., None]:
            def hook(module: Any, args: Any, output: Any) -> None:
                kept[name] = output
                versions[name] = _versions(output)  # as returned, before any later change

            return hook

        handles = [modules[n].register_forward_hook(keep(n)) for n in self.names]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        self.outputs[window] = kept
        self.versions[window] = versions
        self._check(window)

    @contextmanager
    def replaying(self, window: int) -> Iterator[None]:
        """The block with each recorded module swapped for a stub returning its output on
        `window`."""
        swapped = []
        for name in self.names:
            parent_name, _, child = name.rpartition(".")
            parent = self.block.get_submodule(parent_name)
            swapped.append((parent, child, getattr(parent, child)))
            setattr(parent, child, _Stub(self.outputs[window][name]))
        try:
            yield
        finally:
            for parent, child, module in swapped:
                setattr(parent, child, module)
        self._check(window)

    def _check(self, window: int) -> None:
        """End the replay if the forward just run changed a record in place (or did not run
        one of the modules)."""
        now = {name: _versions(output) for name, output in self.outputs[window].items()}
        if now != self.versions[window] or len(now) != len(self.names):  # changed, or not run
            self.names, self.outputs, self.versions = (), {}, {}


class _Stub(torch.nn.Module):
    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


def _versions(value: Any) -> list[int]:
    """The version counters of the tensors in `value` (in-place operations move them)."""
    if isinstance(value, torch.Tensor):
        return [value._version]
    if isinstance(value, (tuple, list)):
        return [v for item in value for v in _versions(item)]
    return []


def _nbytes(value: Any) -> int | None:
    """The bytes of an output made of tensors, tuples, lists and None; None for any other
    value (whose changes the version counters would not show: its module is not replayed)."""
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        sizes = [_nbytes(v) for v in value]
        return None if None in sizes else sum(s for s in sizes if s is not None)
    return None
