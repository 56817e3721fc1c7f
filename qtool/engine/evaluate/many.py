"""Several quantized models against one float pass (`qtool eval FLOAT Q1 Q2 ...`), and the float
side kept in a file (`--save-logits`) or read from one (`--logits`).

The float model runs once over the windows; its side of the figures (every log-probability,
float32, so the figures are those of a pair run, bit for bit) is kept in memory, the float
model's weights are let go (their digests kept for "weights that differ"), and the candidates
are loaded one at a time, each scored and let go before the next: memory holds one model and
the float log-probabilities of the scored positions (positions x vocabulary x 4 bytes). From a
logits file, FLOAT's weights are never read: its config, tokenizer and tensor headers give the
architecture the candidates load into, and the float side is the file's 16-bit codes."""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

from qtool.engine.evaluate.passes import float_pass, scored_pass
from qtool.engine.evaluate.quant import CONFIG_NOISE, load_quant
from qtool.engine.evaluate.run import DTYPES, EvalOptions, evaluate, in_sample, in_sample_note
from qtool.engine.loop import resolve_device
from qtool.engine.model.config import FLOAT, window_length
from qtool.engine.model.models import FloatModel, float_shell, load_float
from qtool.engine.model.text import DEFAULT_SOURCE, Text, default_text, read_text, windows
from qtool.engine.model.tokens import causal_tokens, check_vocabulary
from qtool.engine.source import protected_paths
from qtool.engine.threads import using_threads
from qtool.errors import InputError, OutputError, UsageError
from qtool.eval_results import CAUSAL_LM, EvalSummary, FloatPass
from qtool.formats.logits_file import (
    LogitsInfo,
    read_logits,
    read_logits_info,
    tokens_digest,
    write_logits,
)
from qtool.io.atomic import (
    FileId,
    OutputSet,
    describe_os_error,
    file_id,
    preflight,
    remove_stale_temps,
)
from qtool.numerics.logits import FloatRows, code_log_probs, perplexity
from qtool.results import Progress


def evaluate_all(
    float_dir: Path,
    quants: Sequence[Path],
    options: EvalOptions,
    progress: Progress | None = None,
    logits: Path | None = None,
    save_logits: Path | None = None,
    force: bool = False,
    on_float: Callable[[FloatPass], None] | None = None,
) -> list[EvalSummary]:
    """Every candidate against one float pass; one candidate alone with no logits file runs as
    a pair (run.evaluate: window by window, per-layer rows possible). `logits`: the float side
    from this file (FLOAT's weights never read); `save_logits`: it written there, coded, once
    every candidate is scored (an existing file replaced only with `force`); `on_float` told
    what the float side was measured on and its perplexity once it is known."""
    _refuse_duplicates(quants)
    if len(quants) == 1 and logits is None and save_logits is None:
        return [evaluate(float_dir, quants[0], options, progress)]
    if options.per_layer:
        raise ValueError("per-layer rows compare one candidate with FLOAT, as a pair")
    with using_threads(options.threads):
        text = read_text(options.text) if options.text is not None else default_text()
        files = Files(options, logits, save_logits, force, on_float)
        return _evaluate_many(float_dir, quants, text, files, progress)


@dataclass(frozen=True)
class Files:
    options: EvalOptions
    logits: Path | None
    save_logits: Path | None
    force: bool = False
    on_float: Callable[[FloatPass], None] | None = None


@dataclass(frozen=True)
class FloatSide:
    """What scoring the candidates needs of FLOAT once its weights are gone."""

    reference: FloatModel  # its model on the meta device: the architecture candidates load into
    pieces: list[list[int]]
    rows: list[FloatRows]
    digests: dict[str, str]  # parameter name -> SHA-256 of its bytes as loaded
    ctx: int


def _evaluate_many(
    float_dir: Path,
    quants: Sequence[Path],
    text: Text,
    files: Files,
    progress: Progress | None,
) -> list[EvalSummary]:
    """One summary per candidate, every one against the same float side."""
    options = files.options
    device = resolve_device(options.device)
    started = perf_counter()
    if files.save_logits is not None:
        inputs = [float_dir, *quants, *([options.text] if options.text else [])]
        preflight([files.save_logits], _protected(inputs), force=files.force)
        _refuse_in_model_dir(files.save_logits, [float_dir, *quants])
    if files.logits is not None:
        side = _from_file(float_dir, files.logits, text, options)
    else:
        side = _from_model(float_dir, text, options, device, progress)
    if files.on_float is not None:
        seconds = 0.0 if files.logits is not None else perf_counter() - started
        files.on_float(_float_pass(float_dir, side, text, options, device, seconds))
    with OutputSet() as outputs:  # committed after the last candidate: an interrupt leaves none
        if files.save_logits is not None:
            _save(outputs, files.save_logits, side, text, options)
        summaries = _candidates(float_dir, quants, text, options, side, started, progress)
        outputs.commit()
    return summaries


def _candidates(
    float_dir: Path, quants: Sequence[Path], text: Text, options: EvalOptions, side: FloatSide,
    started: float, progress: Progress | None,
) -> list[EvalSummary]:  # fmt: skip
    dtype, device = DTYPES[options.dtype], resolve_device(options.device)
    summaries: list[EvalSummary] = []
    ids = [i for piece in side.pieces for i in piece]
    for quant in quants:
        if summaries:
            started = perf_counter()
        candidate = load_quant(quant, side.reference, dtype)
        causal_tokens(side.reference.tokenizer, candidate.tokenizer, text, len(ids), quant)
        model = candidate.model.to(device)
        theirs = _digests(model)
        changed = sum(1 for n, d in side.digests.items() if theirs.get(n) != d)
        ready = perf_counter()
        if progress is not None:
            progress.start(len(ids))
        figures = scored_pass(model, side.rows, side.pieces, device, progress)
        done = perf_counter()
        same = in_sample(candidate.texts, text)
        summaries.append(EvalSummary(
            inputs=(str(float_dir), str(quant)), loaded_as=candidate.loaded_as,
            architecture=side.reference.architecture, kind=CAUSAL_LM, text=text.info,
            tokenizer="FLOAT's" if candidate.tokenizer is None else "FLOAT's = QUANT's",
            tokens=len(ids), ctx=side.ctx, windows=len(side.pieces), dtype=options.dtype,
            device=str(device), changed=changed, parameters=len(side.digests), causal=figures,
            encoder=None, layers=None, load_seconds=ready - started, eval_seconds=done - ready,
            notes=(*in_sample_note(same, text), *_notes(changed)), in_sample=same,
        ))  # fmt: skip
        del model, candidate
        gc.collect()  # a loaded model sits in reference cycles: free it before the next loads
    return summaries


def _float_pass(
    float_dir: Path, side: FloatSide, text: Text, options: EvalOptions, device: torch.device,
    seconds: float,
) -> FloatPass:  # fmt: skip
    nll = torch.cat([r.nll for r in side.rows])
    return FloatPass(
        str(float_dir), text.info, sum(map(len, side.pieces)), side.ctx, len(side.pieces),
        len(nll), options.dtype, str(device), perplexity(nll), seconds,
    )  # fmt: skip


def _from_model(
    float_dir: Path, text: Text, options: EvalOptions, device: torch.device,
    progress: Progress | None,
) -> FloatSide:  # fmt: skip
    reference = load_float(float_dir, DTYPES[options.dtype])
    _causal_only(reference)
    ctx = window_length(options.ctx, reference.model.config, float_dir, FLOAT, shortest=2)
    pieces = _pieces(reference, text, options.tokens, ctx)
    model = reference.model.to(device)
    if progress is not None:
        progress.start(sum(map(len, pieces)))
    rows = float_pass(model, pieces, device, progress)
    digests = _digests(model)
    model.to("meta")  # its weights go; the architecture stays for the candidates' loading
    return FloatSide(reference, pieces, rows, digests, ctx)


def _from_file(float_dir: Path, path: Path, text: Text, options: EvalOptions) -> FloatSide:
    """The float side read from `path`, refused unless it was made from this text, these
    tokens and windows, this dtype and FLOAT's config and tokenizer."""
    reference = float_shell(float_dir)
    _causal_only(reference)
    ctx = window_length(options.ctx, reference.model.config, float_dir, FLOAT, shortest=2)
    pieces = _pieces(reference, text, options.tokens, ctx)
    ids = [i for piece in pieces for i in piece]
    config, tokenizer = identity(reference)
    vocab = reference.model.get_input_embeddings().num_embeddings

    def expect(info: LogitsInfo) -> None:  # the header, before any array is read
        checks = [
            ("text (SHA-256)", info.text_sha256, text.info.sha256),
            ("window length", info.ctx, ctx),
            ("dtype", info.dtype, options.dtype),
            ("model config (SHA-256)", info.config_sha256, config),
            ("tokenizer (SHA-256)", info.tokenizer_sha256, tokenizer),
            ("vocabulary (FLOAT's embedding rows)", info.vocab, vocab),
            ("token count", info.tokens, len(ids)),
            ("token ids (SHA-256)", info.tokens_sha256, tokens_digest(ids)),
            ("window count", len(info.windows), len(pieces)),
        ]
        for what, theirs, ours in checks:
            if theirs != ours:
                raise InputError(
                    path, f"its {what} differs: saved {_short(theirs)}, this run's {_short(ours)}; "
                    "evaluate on what it was saved from, or save it again",
                )  # fmt: skip
        if [len(p) for p in pieces] != list(info.windows):
            raise InputError(path, "its windows are not this run's; save it again")

    _, saved_ids, rows, digests = read_logits(path, expect)
    if saved_ids != ids:
        raise InputError(path, "its tokens are not this run's; save it again")
    return FloatSide(reference, pieces, rows, digests, ctx)


def _save(
    outputs: OutputSet, path: Path, side: FloatSide, text: Text, options: EvalOptions
) -> None:
    config, tokenizer = identity(side.reference)
    ids = [i for piece in side.pieces for i in piece]
    # the text's absolute path: --logits finds it from any directory (its SHA-256 still checked)
    source = text.info.source if options.text is None else str(options.text.resolve())
    info = LogitsInfo(
        text.info.sha256, source, tokens_digest(ids), len(ids), side.ctx,
        options.dtype, config, tokenizer, side.reference.architecture,
        side.reference.model.get_input_embeddings().num_embeddings,
        tuple(len(p) for p in side.pieces),
    )  # fmt: skip
    rows = [_coded(r) for r in side.rows]
    remove_stale_temps(path.parent)
    try:
        write_logits(outputs.create(path), info, ids, rows, side.digests)
    except OSError as err:  # a full disk, a file-size limit
        why = describe_os_error(err).replace(" with -o", "")  # eval has no -o
        raise OutputError(path, f"cannot write: {why}") from err


def _refuse_duplicates(quants: Sequence[Path]) -> None:
    """The same candidate twice (another spelling, a link) would give two rows of one model."""
    seen: dict[FileId, Path] = {}
    for quant in quants:
        key = file_id(quant)
        if key is not None and key in seen:
            raise UsageError(quant, f"is {seen[key]} again; give each QUANT once")
        if key is not None:
            seen[key] = quant


def _refuse_in_model_dir(out: Path, models: list[Path]) -> None:
    """A new file in a model's directory changes the model (a stray *.safetensors.index.json
    makes it sharded): the output's directory is compared with each model directory by device
    and inode, links resolved."""
    parent = file_id(out.parent)
    for model in models:
        if parent is not None and model.is_dir() and file_id(model) == parent:
            raise OutputError(out, f"is inside the model directory {model}; write it elsewhere")


def _protected(inputs: list[Path]) -> list[Path]:
    """The inputs, the files directly in those that are directories (FLOAT's weights, an
    export's shards) and what belongs to each (a sidecar): never replaced by the logits file."""
    files = [c for p in inputs if p.is_dir() for c in p.iterdir()]
    return protected_paths([*inputs, *files])


def saved_defaults(
    path: Path | None, text: Path | None, tokens: int | None, ctx: int | None, dtype: str | None
) -> tuple[Path | None, int, int | None, str]:
    """text, tokens, ctx and dtype, each where not given from the logits file `path` (its text
    from where it was read, the default text's from this Python), else the defaults; a value
    given stays, and _from_file refuses it where it differs from the file's."""
    base = EvalOptions()
    if path is None:
        return text, tokens or base.tokens, ctx, dtype or base.dtype
    info = read_logits_info(path)
    if dtype is None and info.dtype not in DTYPES:
        raise InputError(path, f"its dtype {_short(info.dtype)!r} is none qtool runs models in")
    return (
        text if text is not None else _saved_text(path, info.text_source),
        tokens or info.tokens,
        ctx or info.ctx,
        dtype or info.dtype,
    )


def _saved_text(path: Path, source: str) -> Path | None:
    """The text file a logits file was saved on (None: the default text); its SHA-256 is
    checked against the file's when the float side is read."""
    if source.startswith(DEFAULT_SOURCE):
        return None
    saved = Path(source)
    if not saved.is_file():
        raise UsageError(
            path, f"it was saved on the text {source[:300]!r}, which is not a file here; give "
            "that text", hint="text",
        )  # fmt: skip
    return saved


def _coded(rows: FloatRows) -> FloatRows:
    assert rows.logp is not None
    return FloatRows(rows.nll, rows.argmax, None, code_log_probs(rows.logp))


def identity(reference: FloatModel) -> tuple[str, str]:
    """SHA-256 of FLOAT's config (as transformers reads it, less CONFIG_NOISE) and of its
    tokenizer: a fast tokenizer's whole definition (vocabulary, merges, pre- and
    post-processing), else its vocabulary and special tokens."""
    conf = {k: v for k, v in reference.model.config.to_dict().items() if k not in CONFIG_NOISE}
    backend = reference.tokenizer.backend
    fast = getattr(backend, "backend_tokenizer", None)
    tokenizer = {
        "definition": fast.to_str() if fast is not None else None,
        "vocab": None if fast is not None else sorted(backend.get_vocab().items()),
        "special": sorted(map(str, backend.all_special_tokens)),
        "class": type(backend).__name__,
    }
    return _sha(conf), _sha(tokenizer)


def _sha(doc: object) -> str:
    data = json.dumps(doc, sort_keys=True, default=str).encode()
    return hashlib.sha256(data).hexdigest()


def _short(value: object) -> str:
    return f"{value[:12]}..." if isinstance(value, str) and len(value) > 16 else f"{value}"


def _digests(model: Any) -> dict[str, str]:
    """SHA-256 of each parameter's bytes as loaded (a tied weight once, under its first name)."""
    out = {}
    for name, p in model.named_parameters():
        data = p.detach().contiguous().cpu().view(torch.uint8).numpy()
        out[name] = hashlib.sha256(data.tobytes()).hexdigest()
    return out


def _pieces(reference: FloatModel, text: Text, limit: int, ctx: int) -> list[list[int]]:
    ids = causal_tokens(reference.tokenizer, None, text, limit, reference.path)
    pieces = [ids[s:e] for s, e in windows(len(ids), ctx)]
    check_vocabulary(pieces, reference.model.get_input_embeddings().num_embeddings,
                     reference.tokenizer)  # fmt: skip
    return pieces


def _causal_only(reference: FloatModel) -> None:
    if reference.kind != CAUSAL_LM:
        raise UsageError(
            reference.path, "is an encoder: several QUANTs, and saved logits, are for causal LMs; "
            "evaluate one QUANT at a time",
        )  # fmt: skip


def _notes(changed: int) -> tuple[str, ...]:
    if changed:
        return ()
    return ("QUANT's weights equal FLOAT's: it is not quantized (or it is FLOAT itself)",)
