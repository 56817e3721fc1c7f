"""`qtool calibrate --sensitivity`: alpha_L of every Linear of every decoder block, measured
(numerics/sensitivity.py: predicted KL = sum alpha_L r_L).

For Linear L of block b: its weight is perturbed by the reference error (round to nearest on
numerics.sensitivity.REFERENCE's grid), block b runs on the float model's activations entering
it, and the result (a *stream*: the hidden states of the model with L alone perturbed) runs
through blocks b+1..N, the final norm and the head; KL(float || stream) per scored position,
averaged as `qtool eval` averages it, divided by the perturbation's r_L (from the importance
matrix) is alpha_L.

One block's weights at a time: a pass loads each block once and runs it on the float stream and
on every perturbed stream alive at that block, so the streams of a group of Linears are held at
once (windows x ctx x hidden float32 each). Groups are sized so that their streams stay within
MAX_STREAM_BYTES; each group is one pass over every block (block loads = groups x blocks).

The ends too, in the first pass, so that every tensor an allocation may quantize has an alpha:
the input embedding (its stream is born before block 0: the embeddings run with the perturbed
table; with a tied head the same perturbed table also makes that stream's logits) and an untied
output head (the float final states through the perturbed head). Their r has the imatrix's h
where it has their entry, else h = 1, as quantize's allocation computes it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, cast

import torch

from qtool.calibrate_results import JointSummary, LinearSensitivity, SensitivitySummary
from qtool.engine.calibrate.blocks import (
    block_list,
    capture,
    load_module,
    prepare_base,
    return_freed_memory,
)
from qtool.engine.model.head_kl import window_kl
from qtool.errors import InputError
from qtool.formats.base import FloatReader
from qtool.formats.imatrix.sensitivity import Sensitivities, sensitivity_keys
from qtool.io.gguf_layout import GGUFValue
from qtool.numerics.allocate import relative_error
from qtool.numerics.imatrix import MatrixStats
from qtool.numerics.sensitivity import REFERENCE, alpha, joint_fit, reference_error
from qtool.results import Progress

MAX_STREAM_BYTES = 2 << 30
"""The perturbed streams held at once (each windows x ctx x hidden float32, in memory): Linears
past it are measured in further passes over the blocks."""


@dataclass(frozen=True)
class Sensitivity:
    """One Linear's measurement: the reference error's r, the mean KL it caused, their ratio."""

    r: float
    kl: float
    alpha: float


@dataclass
class PassCount:
    """What the measurement loaded: passes over the blocks, block loads (tests count them)."""

    passes: int = 0
    block_loads: int = 0


@dataclass(frozen=True)
class Joint:
    """The KL of the joint reference perturbation (every measured tensor at once) at the
    reference (`kl`) and at half of it (`kl_half`: a quarter of every r), over all the
    calibration windows (`tokens`), and at the reference over the sensitivity windows alone
    (`kl_few`)."""

    kl: float
    kl_half: float
    tokens: int
    kl_few: float

    def fit(self, found: Mapping[str, Sensitivity]) -> tuple[float, float, float] | None:
        """numerics.sensitivity.joint_fit's (gain, saturation) through the two joint points,
        S = sum of the single KLs at the reference, and the additivity kl_few / S; None when
        nothing was perturbed, a KL is 0, or the two points fit no curve (kl_half >= kl)."""
        single = sum(s.kl for s in found.values())
        if not (0.0 < single < math.inf and self.kl > 0.0 and self.kl_half > 0.0):
            return None
        fit = joint_fit(single, self.kl, single / 4, self.kl_half)
        if fit is None or not math.isfinite(self.kl_few / single):
            return None
        return fit[0], fit[1], self.kl_few / single


@dataclass(frozen=True)
class Measured:
    """What sensitivity_of measured (nothing when it was not asked for), by checkpoint name."""

    found: dict[str, Sensitivity] = field(default_factory=dict)
    windows: int = 0
    tokens: int = 0
    count: PassCount = field(default_factory=PassCount)
    seconds: float = 0.0
    joint: Joint | None = None
    llama: dict[str, str] = field(default_factory=dict)  # set by keys()

    def keys(self, names: Mapping[str, str]) -> dict[str, GGUFValue]:
        """The imatrix's metadata keys, under llama.cpp's `names` (checkpoint -> llama.cpp)."""
        if not self.found:
            return {}
        self.llama.update({n: names[n] for n in self.found})
        alphas = {names[n]: s.alpha for n, s in self.found.items()}
        fit = None if self.joint is None else self.joint.fit(self.found)
        return sensitivity_keys(Sensitivities(alphas, REFERENCE, self.tokens, fit))

    def summary(self) -> SensitivitySummary | None:
        if not self.found:
            return None
        rows = tuple(
            LinearSensitivity(self.llama.get(n, n), s.r, s.kl, s.alpha)
            for n, s in self.found.items()
        )  # fmt: skip
        joint = None
        if self.joint is not None:
            j = self.joint
            joint = JointSummary(j.kl, j.kl_half, j.tokens, j.kl_few, j.fit(self.found))
        return SensitivitySummary(REFERENCE, self.tokens, self.windows, self.count.passes,
                                  self.count.block_loads, self.seconds, rows, joint)  # fmt: skip


def sensitivity_of(
    model: Any,
    reader: FloatReader,
    windows: list[list[int]],
    device: torch.device,
    path: Any,
    stats: Mapping[str, MatrixStats],
    tokens: int,
    progress: Progress | None = None,
) -> Measured:
    """measure() on the first `tokens` // ctx windows of `windows` (at least one; 0 tokens:
    nothing measured); the imatrix `stats` came from all of them."""
    if tokens <= 0:
        return Measured()
    taken = windows[: max(1, tokens // len(windows[0]))]
    started = perf_counter()
    count = PassCount()
    found = measure(model, reader, taken, device, path, stats, progress, count=count)
    joint = joint_kl(model, reader, windows, len(taken), device, path, set(found), count,
                     progress)  # fmt: skip
    return Measured(found, len(taken), len(taken) * len(taken[0]), count,
                    perf_counter() - started, joint)  # fmt: skip


def joint_kl(
    model: Any,
    reader: FloatReader,
    windows: list[list[int]],
    few: int,
    device: torch.device,
    path: Any,
    names: set[str],
    count: PassCount,
    progress: Progress | None = None,
) -> Joint:
    """One more pass: every tensor of `names` at the reference at once, and at half of it (the
    embedding's table too, tied head included), on as many of `windows` as three streams fit
    MAX_STREAM_BYTES (at least the first `few`, the sensitivity windows); KL over them all and
    (at the reference) over the first few."""
    stream_bytes = len(windows[0]) * int(model.config.hidden_size) * 4
    taken = windows[: max(few, min(len(windows), MAX_STREAM_BYTES // (3 * stream_bytes)))]
    base, layers, layers_name = block_list(model, path)
    prepare_base(base, layers_name, reader, device, path)
    clean, kwargs = capture(base, layers, taken, device)
    table = model.get_input_embeddings()
    embedding = f"{_module_name(model, table)}.weight"
    perturbed = {1.0: [x.clone() for x in clean], 0.5: [x.clone() for x in clean]}
    if embedding in names:
        for k in perturbed:
            with _at_reference(table, factor=k):
                perturbed[k], _ = capture(base, layers, taken, device)
    _free_base(base)
    count.passes += 1
    if progress is not None:  # three streams (float, reference, half) through every block
        progress.start(3 * len(layers) * len(taken) * len(taken[0]))
    for i, block in enumerate(layers):
        prefix = f"{layers_name}.{i}."
        load_module(block, prefix, reader, device, path)
        count.block_loads += 1
        mine = [m for n, m in block.named_modules() if f"{prefix}{n}.weight" in names]
        with torch.no_grad():
            for x in clean:
                x.copy_(block(x, **kwargs[i]))
            _advance(progress, f"joint, block {i}", clean)
            for k, xs in perturbed.items():
                with _at_reference(*mine, factor=k):
                    for x in xs:
                        x.copy_(block(x, **kwargs[i]))
                _advance(progress, f"joint, block {i}", clean)
        block.to_empty(device="meta")
        return_freed_memory()
    norm, weight = _head(model, base, layers_name, reader, device, path)
    weight = weight.detach()
    head = f"{_module_name(model, model.get_output_embeddings())}.weight"
    tied = _head_is_tied(model, reader)
    delta = reference_error(weight) if (embedding if tied else head) in names else None
    sums: dict[float, list[tuple[float, int]]] = {k: [] for k in perturbed}
    moved = {k: weight if delta is None else weight + k * delta for k in perturbed}
    for w in range(len(taken)):
        scored = clean[w].shape[-2] - 1
        kls = window_kl(norm, clean[w], weight,
                        [(xs[w], moved[k]) for k, xs in perturbed.items()], scored)  # fmt: skip
        for k, total in zip(perturbed, kls, strict=True):
            sums[k].append((total, scored))
    _free_base(base)
    out_head = model.get_output_embeddings()
    if out_head is not None and not out_head.weight.is_meta:
        out_head.to_empty(device="meta")
    return_freed_memory()

    def mean(part: list[tuple[float, int]]) -> float:
        return sum(t for t, _ in part) / max(sum(n for _, n in part), 1)

    return Joint(mean(sums[1.0]), mean(sums[0.5]), len(taken) * len(taken[0]),
                 mean(sums[1.0][:few]))  # fmt: skip


class _at_reference:
    """Within it, the weights of `modules` carry `factor` times the reference error; restored
    bit for bit."""

    def __init__(self, *modules: Any, factor: float = 1.0) -> None:
        self.modules, self.kept = modules, [m.weight.detach().clone() for m in modules]
        self.factor = factor

    def __enter__(self) -> None:
        for m, kept in zip(self.modules, self.kept, strict=True):
            m.weight.data.add_(self.factor * reference_error(kept))

    def __exit__(self, *_: object) -> None:
        for m, kept in zip(self.modules, self.kept, strict=True):
            m.weight.data.copy_(kept)


def stream_groups(linears: list[str], stream_bytes: int, bound: int) -> list[list[str]]:
    """`linears` in order, cut into groups whose streams (stream_bytes each) fit `bound` (at
    least one Linear per group: a single stream over the bound is still measured)."""
    size = max(1, bound // max(stream_bytes, 1))
    return [linears[i : i + size] for i in range(0, len(linears), size)]


def measure(
    model: Any,
    reader: FloatReader,
    windows: list[list[int]],
    device: torch.device,
    path: Any,
    stats: Mapping[str, MatrixStats],
    progress: Progress | None = None,
    bound: int | None = None,
    count: PassCount | None = None,
) -> dict[str, Sensitivity]:
    """Sensitivity of every Linear of every decoder block of `model` whose weight `stats` (the
    importance matrix, keyed by the checkpoint's names) covers, measured on `windows`."""
    _, layers, layers_name = block_list(model, path)
    linears = [
        f"{layers_name}.{i}.{name}.weight"
        for i, block in enumerate(layers)
        for name, m in block.named_modules()
        if isinstance(m, torch.nn.Linear) and f"{layers_name}.{i}.{name}.weight" in stats
    ]
    stream_bytes = len(windows) * len(windows[0]) * int(model.config.hidden_size) * 4
    counted = count if count is not None else PassCount()
    limit = MAX_STREAM_BYTES if bound is None else bound
    groups = stream_groups(linears, stream_bytes, limit)
    if progress is not None:
        runs = sum(_runs(g, layers_name, len(layers)) for g in groups) + len(layers)
        progress.start(runs * len(windows) * len(windows[0]))
    out: dict[str, Sensitivity] = {}
    for k, group in enumerate(groups or [[]]):
        out |= _one_pass(model, reader, windows, device, path, stats, group, progress, counted,
                         ends=k == 0)  # fmt: skip
    return out


def _runs(group: list[str], layers_name: str, blocks: int) -> int:
    """Block forwards a pass over `group` makes: at each block, the float stream and every
    stream alive there (made at that block or before)."""
    first = [int(n[len(layers_name) + 1 :].split(".")[0]) for n in group]
    return sum(1 + sum(b <= i for b in first) for i in range(blocks))


def _one_pass(
    model: Any,
    reader: FloatReader,
    windows: list[list[int]],
    device: torch.device,
    path: Any,
    stats: Mapping[str, MatrixStats],
    group: list[str],
    progress: Progress | None,
    count: PassCount,
    ends: bool = False,
) -> dict[str, Sensitivity]:
    base, layers, layers_name = block_list(model, path)
    prepare_base(base, layers_name, reader, device, path)
    clean, kwargs = capture(base, layers, windows, device)
    errors: dict[str, float] = {}
    streams: dict[str, list[torch.Tensor]] = {}
    if ends:
        name, errors[name], streams[name] = _embedding_stream(model, base, layers, windows,
                                                               device, stats)  # fmt: skip
    _free_base(base)
    count.passes += 1
    for i, block in enumerate(layers):
        prefix = f"{layers_name}.{i}."
        mine = [n for n in group if n.startswith(prefix)]
        load_module(block, prefix, reader, device, path)
        count.block_loads += 1
        with torch.no_grad():
            older = list(streams.values())
            for name in mine:
                linear = cast(torch.nn.Linear, block.get_submodule(name[len(prefix) : -7]))
                errors[name], streams[name] = _perturbed(
                    block, linear, stats[name], clean, kwargs[i]
                )
                _advance(progress, f"block {i}", clean)
            for xs in [*older, clean]:
                for x in xs:
                    x.copy_(block(x, **kwargs[i]))
                _advance(progress, f"block {i}", clean)
        block.to_empty(device="meta")
        return_freed_memory()
    kls = _divergences(model, base, layers_name, reader, device, path, windows, clean, streams,
                       stats, errors, ends)  # fmt: skip
    return {n: Sensitivity(errors[n], kls[n], alpha(kls[n], errors[n])) for n in kls}


def _module_name(model: Any, module: Any) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None)


def _h(stats: Mapping[str, MatrixStats], name: str) -> torch.Tensor | None:
    found = stats.get(name)
    return None if found is None else torch.from_numpy(found.mean_squares()[0].copy())


def _embedding_stream(
    model: Any,
    base: Any,
    layers: Any,
    windows: list[list[int]],
    device: torch.device,
    stats: Mapping[str, MatrixStats],
) -> tuple[str, float, list[torch.Tensor]]:
    """(the input embedding's checkpoint name, the r of its reference error, the hidden states
    entering block 0 with it) from the base model's own forward; the table is restored."""
    table = model.get_input_embeddings()
    name = f"{_module_name(model, table)}.weight"
    kept = table.weight.detach().clone()
    delta = reference_error(kept)
    r = relative_error(kept, kept + delta, _h(stats, name))
    try:
        table.weight.data.add_(delta)
        born, _ = capture(base, layers, windows, device)
    finally:
        table.weight.data.copy_(kept)
    return name, r, born


def _perturbed(
    block: torch.nn.Module,
    linear: torch.nn.Linear,
    stats: MatrixStats,
    clean: list[torch.Tensor],
    kwargs: dict[str, Any],
) -> tuple[float, list[torch.Tensor]]:
    """(r of the reference error of `linear`, the block's outputs with it) on the float
    activations `clean`; the weight is restored bit for bit."""
    weight = linear.weight
    kept = weight.detach().clone()
    delta = reference_error(kept)
    h = torch.from_numpy(stats.mean_squares()[0].copy())
    r = relative_error(kept, kept + delta, h)
    try:
        weight.data.add_(delta)
        outs = [block(x, **kwargs).clone() for x in clean]
    finally:
        weight.data.copy_(kept)
    return r, outs


def _free_base(base: Any) -> None:
    for _, child in base.named_children():  # the embeddings are done with until the head
        if not isinstance(child, torch.nn.ModuleList):
            child.to_empty(device="meta")


def _head(model: Any, base: Any, layers_name: str, reader: FloatReader,
          device: torch.device, path: Any) -> tuple[Any, torch.Tensor]:  # fmt: skip
    """(the final norm, the head's weight [V, H]) loaded: the head from the checkpoint, or the
    input embeddings' when the checkpoint has none (tied)."""
    prepare_base(base, layers_name, reader, device, path)
    head = model.get_output_embeddings()
    name = next((n for n, m in model.named_modules() if m is head), None)
    norm = getattr(base, "norm", None)
    if head is None or name is None or norm is None:
        raise InputError(path, f"{type(model).__name__} has no final norm and output head qtool "
                         "can run; calibrate --sensitivity supports the Llama family")  # fmt: skip
    if f"{name}.weight" in set(reader.names):
        load_module(head, f"{name}.", reader, device, path)
        return norm, head.weight
    return norm, model.get_input_embeddings().weight


def _head_is_tied(model: Any, reader: FloatReader) -> bool:
    """Whether _head uses the input embeddings' table (the checkpoint has no head of its own)."""
    head = model.get_output_embeddings()
    return f"{_module_name(model, head)}.weight" not in set(reader.names)


def _divergences(
    model: Any,
    base: Any,
    layers_name: str,
    reader: FloatReader,
    device: torch.device,
    path: Any,
    windows: list[list[int]],
    clean: list[torch.Tensor],
    streams: dict[str, list[torch.Tensor]],
    stats: Mapping[str, MatrixStats],
    errors: dict[str, float],
    ends: bool,
) -> dict[str, float]:
    """Mean KL(float || stream) over every scored position (a window of L tokens scores its
    first L - 1, as qtool eval does) per stream. With `ends`, the embedding's stream (the
    first) goes through the perturbed table when the head is tied to it; an untied head gets
    a stream of its own (the float states through the perturbed head, its r into `errors`)."""
    norm, weight = _head(model, base, layers_name, reader, device, path)
    weight = weight.detach()  # a loaded head may require grad; no figure here is a graph
    heads = dict.fromkeys(streams, weight)
    if ends:
        delta = reference_error(weight)
        if _head_is_tied(model, reader):
            name = next(iter(streams))
        else:
            name = f"{_module_name(model, model.get_output_embeddings())}.weight"
            errors[name] = relative_error(weight, weight + delta, _h(stats, name))
            streams = {**streams, name: clean}
        heads[name] = weight + delta
    sums = dict.fromkeys(streams, 0.0)
    positions = 0
    for w in range(len(windows)):
        scored = clean[w].shape[-2] - 1
        positions += scored
        kls = window_kl(norm, clean[w], weight,
                        [(xs[w], heads[name]) for name, xs in streams.items()], scored)  # fmt: skip
        for name, kl in zip(streams, kls, strict=True):
            sums[name] += kl
    _free_base(base)
    head = model.get_output_embeddings()
    if head is not None and not head.weight.is_meta:
        head.to_empty(device="meta")
    return_freed_memory()
    return {name: s / max(positions, 1) for name, s in sums.items()}


def _advance(progress: Progress | None, what: str, xs: list[torch.Tensor]) -> None:
    if progress is not None:
        progress.advance(what, sum(x.shape[-2] for x in xs))
