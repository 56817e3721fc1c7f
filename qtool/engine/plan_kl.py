"""--target-kl's measured figure: the mean KL(float || the planned model) per scored token on
windows of calibrate's default text that the importance matrix did not read (docs/calibration.md,
"--target-kl: measured, then re-solved").

The model runs one decoder block at a time, as calibrate runs it: the embeddings once, then each
block loaded and run on the float stream (the first measurement only: its final states are kept
for the later ones) and on the plan's stream, every tensor the plan quantizes replaced by its
weight as its codes restore it (`Restore`); the final norm and the head (the plan's, or its
embedding table when tied) score each window as `qtool eval` does (a window of L tokens scores
its first L - 1 positions).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qtool.engine.calibrate.blocks import (
    block_list,
    capture,
    load_module,
    prepare_base,
    return_freed_memory,
)
from qtool.engine.calibrate.data import default_text
from qtool.engine.calibrate.run import MODEL
from qtool.engine.model.config import float_source, kind_of
from qtool.engine.model.head_kl import window_kl
from qtool.engine.model.hf import has_tokenizer
from qtool.engine.model.models import empty_model, float_parts
from qtool.engine.model.text import windows
from qtool.engine.model.tokens import check_vocabulary, leading_ids
from qtool.errors import QtoolError
from qtool.eval_results import CAUSAL_LM
from qtool.formats.base import FloatReader
from qtool.formats.imatrix.naming import GGUF_ARCHS
from qtool.formats.registry import open_reader
from qtool.io.gguf_layout import GGUFValue

MEASURE_TOKENS = 2048
"""Tokens a measurement scores (4 windows of 512): each solve of a --target-kl run costs one
pass of the quantized model over them (and the float model's once)."""
TEXT_TOKENS = 1 << 21
"""The most of the text tokenized to spread the windows over (the default text is 240,390
tokens for SmolLM2's tokenizer, 3.9 s to tokenize at one thread)."""

Restore = Callable[[str], torch.Tensor | None]
"""Checkpoint name -> the tensor as the plan's output restores it (None: as the checkpoint
holds it, kept float)."""


@dataclass(frozen=True)
class HeldOut:
    """Where the measurement scores: `text` (its name), the windows, and the tokens of the
    text's start that the importance matrix read and the windows leave out (0: the imatrix
    was calibrated on another text, or records none)."""

    text: str
    windows: list[list[int]]
    skipped: int
    in_sample: bool = False  # the imatrix read the whole text: its first windows, not held out

    @property
    def tokens(self) -> int:
        return sum(len(w) - 1 for w in self.windows)  # scored positions

    def describe(self) -> str:
        """'2,044 tokens of stdlib docstrings (CPython 3.11.7) past the imatrix's 4,096'
        (the windows spread over the rest of the text)."""
        if self.in_sample:
            where = f"(all read by the imatrix, {self.skipped:,} tokens: not held out)"
        elif self.skipped:
            where = f"past the imatrix's {self.skipped:,}"
        else:
            where = "(not the imatrix's calibration text)"
        return f"{self.tokens:,} tokens of {self.text} {where}"


def cannot_run(directory: Path | None) -> str | None:
    """Why the input cannot be run to measure a plan (None: it can): a file, not a model
    directory; a model outside the Llama family; no tokenizer."""
    if directory is None:
        return "the input is a file, not a model directory qtool can run"
    if not (directory / "config.json").is_file():
        return "the input directory has no config.json"
    try:
        _, config = float_source(directory, MODEL)
    except QtoolError:  # a refusal of the input is the writing pass's to make, in its words
        return "its config.json describes no model qtool can run"
    kind, architecture = kind_of(config)
    if kind != CAUSAL_LM or str(config.get("model_type")) not in GGUF_ARCHS:
        return f"qtool runs the Llama family ({', '.join(GGUF_ARCHS)}), not {architecture}"
    if not has_tokenizer(directory):
        return "the input directory has no tokenizer"
    return None


class PlanKL:
    """Measures plans of one model on one set of held-out windows; the float model's final
    states are computed by the first measurement and kept. Close it (a context manager)."""

    def __init__(self, directory: Path, device: torch.device, imatrix: dict[str, GGUFValue]):
        found, config = float_source(directory, MODEL)
        kind, _ = kind_of(config)
        checkpoint, hf_config, tokenizer = float_parts(found, config, directory, MODEL)
        self.path, self.device = directory, device
        self.held = held_out(tokenizer, hf_config, imatrix)
        self.model = empty_model(kind, config, hf_config, checkpoint, directory).eval()
        rows = self.model.get_input_embeddings().num_embeddings
        check_vocabulary(self.held.windows, rows, tokenizer)
        self.reader: FloatReader = open_reader(found)
        self.float_states: list[torch.Tensor] | None = None
        self.measurements = 0  # tests count them
        self.placed: set[str] = set()  # the names the last measurement took from its Restore

    def __enter__(self) -> PlanKL:
        return self

    def __exit__(self, *_: object) -> None:
        try:
            self.reader.check_unchanged()
        finally:
            self.reader.close()

    def measure(self, restore: Restore) -> float:
        """The mean KL(float || plan) per scored position of the held-out windows."""
        self.measurements += 1
        self.placed = set()
        model, path, device, windows = self.model, self.path, self.device, self.held.windows
        base, layers, layers_name = block_list(model, path)
        prepare_base(base, layers_name, self.reader, device, path)
        table = model.get_input_embeddings()
        embedding = _name(model, table)
        first = self.float_states is None
        clean, kwargs = capture(base, layers, windows, device) if first else ([], {})
        with _replaced(table, self._taken(restore, embedding)):
            planned, kwargs_planned = capture(base, layers, windows, device)
        kwargs = kwargs or kwargs_planned
        for i, block in enumerate(layers):
            prefix = f"{layers_name}.{i}."
            load_module(block, prefix, self.reader, device, path)
            with torch.no_grad():
                for x in clean:
                    x.copy_(block(x, **kwargs[i]))
                for name, module in block.named_modules():
                    if isinstance(module, torch.nn.Linear):
                        value = self._taken(restore, f"{prefix}{name}.weight")
                        if value is not None:
                            module.weight.data.copy_(value)
                for x in planned:
                    x.copy_(block(x, **kwargs[i]))
            block.to_empty(device="meta")
            return_freed_memory()
        if first:
            self.float_states = clean
        states = self.float_states
        assert states is not None
        norm = getattr(base, "norm", None)
        assert isinstance(norm, torch.nn.Module)  # block_list's Llama family has one
        head_name = _name(model, model.get_output_embeddings())
        if head_name in set(self.reader.names):
            head = self.reader.values(head_name).to(device=device, dtype=torch.float32)
            self.reader.release(head_name)
            planned_head = self._taken(restore, head_name)
        else:  # tied: the table is the head, as the output stores it
            head = table.weight.detach().float()
            planned_head = self._taken(restore, embedding)
        moved = head if planned_head is None else planned_head.to(device, torch.float32)
        total, positions = 0.0, 0
        for w, ids in enumerate(windows):
            scored = len(ids) - 1
            total += window_kl(norm, states[w], head, [(planned[w], moved)], scored)[0]
            positions += scored
        for _, child in base.named_children():
            if not isinstance(child, torch.nn.ModuleList):
                child.to_empty(device="meta")
        return_freed_memory()
        return total / positions if positions else math.nan

    def _taken(self, restore: Restore, name: str) -> torch.Tensor | None:
        value = restore(name)
        if value is not None:
            self.placed.add(name)
        return value


def held_out(tokenizer: Any, hf_config: Any, imatrix: dict[str, GGUFValue]) -> HeldOut:
    """Windows of calibrate's default text past those the imatrix read (its qtool.datasets.*
    say whether it read this text and how many tokens), of the imatrix's chunk size (at most
    the model's max_position_embeddings and MEASURE_TOKENS: both sizes are the input's to
    claim), cut as qtool eval cuts a text: MEASURE_TOKENS of them, spread evenly over the rest
    of the text (the text runs module by module: the windows right after the imatrix's
    measured 5-14 % apart from those it read on SmolLM2)."""
    text = default_text()
    chunk = _int(imatrix.get("imatrix.chunk_size"))
    limit = getattr(hf_config, "max_position_embeddings", None)
    ctx = chunk if chunk and chunk > 1 else 512
    if isinstance(limit, int) and limit >= 2:
        ctx = min(ctx, limit)
    ctx = min(ctx, MEASURE_TOKENS)  # both come from input files: a window is never longer
    skipped = _tokens_read(imatrix, text.info.sha256)
    start = -(-skipped // ctx) * ctx  # the first window boundary past them
    ids = leading_ids(tokenizer, text.content, TEXT_TOKENS)
    spans = windows(len(ids), ctx)  # as qtool eval cuts a text (no BOS put in)
    held = [ids[s:e] for s, e in spans if s >= start and e - s == ctx]
    if held:
        return HeldOut(text.source, spread(held, max(1, MEASURE_TOKENS // ctx)), skipped)
    every = [ids[s:e] for s, e in spans if e - s == ctx] or [ids[s:e] for s, e in spans]
    in_sample = skipped > 0  # else the text is shorter than one window: nothing was read
    return HeldOut(text.source, spread(every, max(1, MEASURE_TOKENS // ctx)), skipped, in_sample)


def spread(items: list[list[int]], count: int) -> list[list[int]]:
    """`count` of `items` evenly spaced (the middle of each of `count` equal strata), in
    order; all of them when there are no more."""
    n = len(items)
    if n <= count:
        return items
    return [items[(2 * i + 1) * n // (2 * count)] for i in range(count)]


def _tokens_read(imatrix: dict[str, GGUFValue], sha256: str) -> int:
    """The tokens of the text of `sha256` the imatrix records reading (0: none)."""
    shas = imatrix.get("qtool.datasets.sha256")
    counts = imatrix.get("qtool.datasets.tokens")
    if shas is None or counts is None:
        return 0
    names = list(shas.value) if isinstance(shas.value, (tuple, list, np.ndarray)) else []
    tokens = list(counts.value) if isinstance(counts.value, (tuple, list, np.ndarray)) else []
    for name, count in zip(names, tokens, strict=False):
        if name == sha256:  # a count that is no integer (NaN, a string) records nothing
            return max(0, int(count)) if isinstance(count, (int, np.integer)) else 0
    return 0


def _int(value: GGUFValue | None) -> int | None:
    got = None if value is None else value.value
    return int(got) if isinstance(got, (int, np.integer)) else None


def _name(model: Any, module: Any) -> str:
    found = next((n for n, m in model.named_modules() if m is module), None)
    return f"{found}.weight"


class _replaced:
    """Within it, `module`'s weight holds `value` (None: unchanged); restored after."""

    def __init__(self, module: Any, value: torch.Tensor | None) -> None:
        self.module, self.value = module, value
        self.kept = None if value is None else module.weight.detach().clone()

    def __enter__(self) -> None:
        if self.value is not None:
            self.module.weight.data.copy_(self.value)

    def __exit__(self, *_: object) -> None:
        if self.kept is not None:
            self.module.weight.data.copy_(self.kept)
