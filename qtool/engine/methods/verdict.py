"""The model-level verdict of a calibrated run (docs/calibration.md, "Model KL at the end of the
run"): the model's KL(float || quantized) per scored token on the held-out windows and on the
check text, for the result the guard chose and for round to nearest on the same grid.

The sequential pass already loads each block and carries the chosen result's activations of
every stream (engine/calibrate/sequential.py). ModelStreams carries two more copies of the
held-out and check windows' activations through the same block loads: the float model's (the
block run as loaded, before the method touches it) and round to nearest's (the block read again
from the checkpoint, its target Linears rounded to nearest as a consumer restores them). At the
end the final norm and the head (float, read once) turn each stream into logits, scored as
`qtool eval` scores windows (numerics/logits: the logits at position i predict token i + 1; a
window of L tokens scores L - 1 positions). Embeddings and head are the float model's for all
three: the figures measure the decoder blocks, where the method and rounding differ."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from qtool.engine.calibrate.blocks import block_list, load_module, return_freed_memory
from qtool.engine.calibrate.sequential import ACTIVATIONS_IN_MEMORY, spilled
from qtool.engine.methods.gptq import Target, restored
from qtool.engine.model.head_kl import window_kl
from qtool.errors import InputError
from qtool.formats.base import FloatReader
from qtool.numerics.kernels import quantize_with
from qtool.results import ModelKL

STREAMS = {"held": "held-out", "check": "check text"}  # stream -> what the report calls it


class ModelStreams:
    """The float and round-to-nearest activations of the held-out and check windows, carried
    through the blocks beside the chosen result's (the sequential pass's own)."""

    carried = tuple(STREAMS)  # the chosen streams figures() reads after the last block

    def __init__(
        self,
        targets: Mapping[str, Target],
        scales_in_weight_dtype: bool,
        directory: Path | None = None,
        rounded: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.targets = targets
        # `rounded`: a method that changes nothing of a block but its targets' weights and
        # rounds each one to nearest anyway (GPTQ's guard) gives those reconstructions here;
        # the rounding stream then takes them instead of reading and rounding the block again
        self.given = rounded
        self.scales_in_weight_dtype = scales_in_weight_dtype
        self.directory = directory  # where the copies are mapped past ACTIVATIONS_IN_MEMORY
        self.chosen: dict[str, Sequence[torch.Tensor]] = {}
        self.float: dict[str, list[torch.Tensor]] = {}
        self.rounded: dict[str, list[torch.Tensor]] = {}

    def start(self, streams: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """The activations entering the first block, per stream (the pass keeps updating
        `streams` in place: they are the chosen result's)."""
        self.chosen = {s: streams[s] for s in STREAMS if s in streams}
        every = [x for xs in self.chosen.values() for x in xs]
        if not every:
            return
        _, ctx, width = every[0].shape
        # both copies, as many bytes as those streams' activations: mapped past the same bound
        mapped = spilled(2 * len(every), ctx, width, every[0].device, ACTIVATIONS_IN_MEMORY,
                         self.directory)  # fmt: skip
        copies = iter(mapped) if mapped is not None else None
        for kept in (self.float, self.rounded):
            for s, xs in self.chosen.items():
                kept[s] = [x.clone() if copies is None else next(copies).copy_(x) for x in xs]

    def before(self, block: torch.nn.Module, kwargs: dict[str, Any]) -> None:
        """The float stream through the block as loaded (before the method changes it)."""
        _run(block, self.float, kwargs)

    def after(
        self,
        block: torch.nn.Module,
        prefix: str,
        kwargs: dict[str, Any],
        reload: Callable[[], None],
    ) -> None:
        """The rounding stream through the block with its targets rounded to nearest: the
        block read again and rounded, or (`given`) the method's own roundings put in place of
        its weights, a target it left alone (still as loaded) rounded here."""
        if self.given is None:
            reload()
        with torch.no_grad():
            for name, module in block.named_modules():
                key = f"{prefix}{name}.weight"
                target = self.targets.get(key)
                if target is not None and isinstance(module, torch.nn.Linear):
                    made = self.given.pop(key, None) if self.given is not None else None
                    if made is None:
                        made = self._rounded(module.weight.detach(), target)
                    module.weight.data.copy_(made)
        _run(block, self.rounded, kwargs)

    def _rounded(self, weight: torch.Tensor, target: Target) -> torch.Tensor:
        """Round to nearest as the guard's baseline is (methods/gptq.GptqPolicy._choose)."""
        scale_dtype = target.dtype if self.scales_in_weight_dtype else torch.float32
        original = weight.to(target.dtype)
        rtn = quantize_with(original, target.spec, scale_dtype=scale_dtype)
        return restored(rtn, target.spec, target.dtype, tuple(weight.shape))

    def figures(
        self,
        model: Any,
        reader: FloatReader,
        device: torch.device,
        path: Any,
        windows: Mapping[str, Sequence[list[int]]],
    ) -> tuple[ModelKL, ...]:
        """Each stream's mean KL(float || chosen) and KL(float || rounding) per scored token,
        through the float final norm and head (read from the checkpoint here). Called once:
        the streams are let go at its end."""
        return_freed_memory()  # the pass's last block and its fit windows, freed on its return
        norm, head = _head(model, reader, device, path)
        out = []
        for stream, label in STREAMS.items():
            if not self.chosen.get(stream):
                continue
            sums, scored = [0.0, 0.0], 0
            for i, ids in enumerate(windows[stream]):
                xs = (self.float[stream][i], self.chosen[stream][i], self.rounded[stream][i])
                kls = window_kl(norm, xs[0], head, [(x, head) for x in xs[1:]], len(ids) - 1)
                sums = [a + b for a, b in zip(sums, kls, strict=True)]
                scored += len(ids) - 1
                # the window's [rows, vocabulary] temporaries, given back: left in glibc's heap
                # they added up (SmolLM2, 8 windows: the head phase crept from 537 to 621 MiB)
                return_freed_memory()
            chosen, rounding = (s / scored if scored else float("nan") for s in sums)
            out.append(ModelKL(label, scored, chosen, rounding))
        self.chosen, self.float, self.rounded = {}, {}, {}  # spent: not held while writing
        del norm, head
        return_freed_memory()
        return tuple(out)


def _run(
    block: torch.nn.Module, streams: Mapping[str, list[torch.Tensor]], kwargs: dict[str, Any]
) -> None:
    with torch.no_grad():
        for xs in streams.values():
            for x in xs:
                x.copy_(block(x, **kwargs))


def _head(
    model: Any, reader: FloatReader, device: torch.device, path: Any
) -> tuple[torch.nn.Module, torch.Tensor]:
    """The final norm (loaded into the model's own module) and the head's weight:
    `lm_head.weight`, or with tied embeddings the input embeddings' weight."""
    base, _, layers_name = block_list(model, path)
    prefix = layers_name.rsplit(".", 1)[0] + "." if "." in layers_name else ""
    norm = getattr(base, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise InputError(path, f"{type(model).__name__} has no final norm qtool can run")
    load_module(norm, f"{prefix}norm.", reader, device, path)
    names = set(reader.names)
    embeddings = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    name = "lm_head.weight" if "lm_head.weight" in names else f"{embeddings}.weight"
    if name not in names:
        raise InputError(path, "the checkpoint lacks this weight, which the model needs", name)
    stored = reader.values(name)
    # on the CPU as stored where float32 holds it exactly: window_kl widens a slab at a time
    # (SmolLM2's bfloat16 head: 54 MiB held, not 108); the values were read for this call, and
    # are only read here, so they are not copied again
    exact = device.type == "cpu" and stored.is_floating_point() and stored.element_size() <= 4
    head = stored.to(device=device, dtype=stored.dtype if exact else torch.float32)
    reader.release(name)
    return norm, head
