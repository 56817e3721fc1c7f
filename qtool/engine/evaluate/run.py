"""One evaluation: read the text, load FLOAT then QUANT (once each), tokenize, run the passes,
summarise. Loading and evaluation are timed apart (loading dominates small runs)."""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import torch

from qtool.calibration import Role, TextUse
from qtool.engine.evaluate.layers import LayerProbe, changed_parameters
from qtool.engine.evaluate.passes import causal_pass, encoder_pass
from qtool.engine.evaluate.quant import QuantModel, load_quant
from qtool.engine.loop import resolve_device
from qtool.engine.model.config import FLOAT, window_length
from qtool.engine.model.models import FloatModel, load_float
from qtool.engine.model.text import Text, default_text, read_text, windows
from qtool.engine.model.tokens import causal_tokens, check_vocabulary, encoder_pieces
from qtool.engine.threads import using_threads
from qtool.eval_results import CAUSAL_LM, EvalSummary
from qtool.results import Progress

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EvalOptions:
    text: Path | None = None  # None: default_text()
    tokens: int = 4096
    ctx: int | None = None  # None: DEFAULT_CTX, or FLOAT's max_position_embeddings if shorter
    dtype: str = "float32"
    device: str = "auto"
    per_layer: bool = False
    threads: int | None = None  # CPU threads; None: the free cores (engine/threads.py)


def evaluate(
    float_dir: Path, quant: Path, options: EvalOptions, progress: Progress | None = None
) -> EvalSummary:
    with using_threads(options.threads):
        return _evaluate(float_dir, quant, options, progress)


def _evaluate(
    float_dir: Path, quant: Path, options: EvalOptions, progress: Progress | None
) -> EvalSummary:
    text = read_text(options.text) if options.text is not None else default_text()
    device = resolve_device(options.device)
    started = perf_counter()
    reference = load_float(float_dir, DTYPES[options.dtype])
    ctx = window_length(options.ctx, reference.model.config, float_dir, FLOAT, shortest=2)
    candidate = load_quant(quant, reference, DTYPES[options.dtype])
    pieces = _pieces(reference, candidate, text, options.tokens, ctx, quant)
    models = (reference.model.to(device), candidate.model.to(device))
    changed, parameters = changed_parameters(*models)
    ready = perf_counter()
    probe = LayerProbe(*models) if options.per_layer else None
    if progress is not None:
        progress.start(sum(map(len, pieces)))
    with probe if probe is not None else nullcontext():
        if reference.kind == CAUSAL_LM:
            causal, encoder = causal_pass(models, pieces, device, progress), None
        else:
            causal, encoder = None, encoder_pass(models, pieces, device, progress)
    done = perf_counter()
    same = in_sample(candidate.texts, text)
    return EvalSummary(
        inputs=(str(float_dir), str(quant)),
        loaded_as=candidate.loaded_as,
        architecture=reference.architecture,
        kind=reference.kind,
        text=text.info,
        tokenizer="FLOAT's" if candidate.tokenizer is None else "FLOAT's = QUANT's",
        tokens=sum(map(len, pieces)),
        ctx=ctx,
        windows=len(pieces),
        dtype=options.dtype,
        device=str(device),
        changed=changed,
        parameters=parameters,
        causal=causal,
        encoder=encoder,
        layers=probe.rows() if probe is not None else None,
        load_seconds=ready - started,
        eval_seconds=done - ready,
        notes=(*in_sample_note(same, text), *_notes(changed)),
        in_sample=same,
    )


def in_sample(recorded: tuple[TextUse, ...], text: Text) -> tuple[TextUse, ...]:
    """The texts QUANT recorded that are the evaluation text: the same SHA-256, or for a record
    of a name only (llama-quantize's GGUF keys) the same base name."""
    info = text.info
    name = os.path.basename(info.source) or info.source
    return tuple(
        t for t in recorded if t.sha256 == info.sha256 or (t.sha256 is None and t.name == name)
    )


def in_sample_note(same: tuple[TextUse, ...], text: Text) -> tuple[str, ...]:
    """One warning line naming the text and what it was to QUANT's quantization."""
    if not same:
        return ()
    roles = {t.role for t in same}
    what = " and ".join(
        phrase for role, phrase in (
            (Role.CALIBRATION, "a text its quantization was calibrated on"),
            (Role.CHECK, "the check text its calibrated method was judged on"),
        ) if role in roles
    )  # fmt: skip
    by = "by SHA-256" if all(t.sha256 is not None for t in same) else (
        "by name only: the GGUF records the imatrix's dataset by name")  # fmt: skip
    names = ", ".join(dict.fromkeys(t.name for t in same))
    line = (f"in sample: the evaluation text ({text.source}) is {what}, recorded as {names} "
            f"({by}), so these figures flatter QUANT; evaluate on a text it never saw")  # fmt: skip
    return (line,)


def _pieces(
    reference: FloatModel, candidate: QuantModel, text: Text, limit: int, ctx: int, quant: Path
) -> list[list[int]]:
    """The windows of the tokens (causal LM) or the sentences (encoder) both models run on."""
    tokenizers = (reference.tokenizer, candidate.tokenizer)
    if reference.kind == CAUSAL_LM:
        ids = causal_tokens(*tokenizers, text, limit, quant)
        pieces = [ids[s:e] for s, e in windows(len(ids), ctx)]
    else:
        pieces = encoder_pieces(*tokenizers, text, limit, ctx, quant)
    rows = reference.model.get_input_embeddings().num_embeddings
    check_vocabulary(pieces, rows, reference.tokenizer)
    return pieces


def _notes(changed: int) -> tuple[str, ...]:
    if changed:
        return ()
    return ("QUANT's weights equal FLOAT's: it is not quantized (or it is FLOAT itself)",)
