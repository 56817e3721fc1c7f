"""`qtool calibrate`: a float model over calibration text, block by block, into llama.cpp's GGUF
importance matrix (names as llama.cpp's converter gives them); and merges of such files.

The text's names go into imatrix.datasets; qtool adds, per dataset in the same order, its
SHA-256 and token count (qtool.datasets.sha256, qtool.datasets.tokens: keys llama-quantize's
loader skips, as it looks its own up by name)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np

from qtool.calibrate_results import CalibrateSummary, DatasetInfo, MergeSummary
from qtool.engine.calibrate.data import Source, default_text, load_text, take_windows
from qtool.engine.calibrate.sensitivity import sensitivity_of
from qtool.engine.calibrate.sequential import run_blocks
from qtool.engine.layout import check_files
from qtool.engine.loop import resolve_device
from qtool.engine.model.config import Role, float_source, kind_of, window_length
from qtool.engine.model.models import empty_model, float_parts
from qtool.engine.model.tokens import check_vocabulary
from qtool.engine.threads import using_threads
from qtool.errors import InputError, UsageError
from qtool.eval_results import CAUSAL_LM
from qtool.formats import stale_config
from qtool.formats.detect import CONFIG, Detected
from qtool.formats.imatrix import read_imatrix_file, write_imatrix
from qtool.formats.imatrix.naming import IMATRIX_ARCHS, llama_names
from qtool.formats.imatrix.provenance import SHA_KEY, TOKENS_KEY, dataset_infos, warn_same_text
from qtool.formats.imatrix.sensitivity import merged, read_sensitivities, sensitivity_keys
from qtool.formats.registry import open_reader
from qtool.gguf_types import ValueType
from qtool.io.gguf_layout import GGUFValue
from qtool.io.outcheck import refuse_nesting
from qtool.numerics.imatrix import MAX_CHUNK_COUNT, ImportanceMatrix, MatrixStats, merge
from qtool.results import Progress

DEFAULT_TOKENS = 128 * 512
MAX_ACTIVATION_BYTES = 8 << 30
"""The activations at a block boundary (windows x ctx x hidden float32) are held in memory, not
spilled: a run asking for more is refused before anything is read (calibrate slices, merge)."""


def _refusal(path: Path, found: Detected, config: dict[str, object]) -> InputError:
    if found.quantized:
        return InputError(path, f"the model is already quantized ({found.description}); "
                          "calibrate runs the float model it came from")  # fmt: skip
    return stale_config.refusal(config, path / CONFIG)


MODEL = Role("MODEL", "the model", _refusal)


@dataclass(frozen=True)
class CalibrateOptions:
    texts: tuple[Path, ...] = ()  # none: data.default_text()
    tokens: int = DEFAULT_TOKENS
    ctx: int | None = None  # None: DEFAULT_CTX, or the model's max_position_embeddings if less
    device: str = "cpu"
    force: bool = False
    threads: int | None = None
    sensitivity_tokens: int = 0  # > 0: also alpha per Linear on that many tokens (sensitivity.py)


def calibrate(
    model_dir: Path,
    out: Path,
    options: CalibrateOptions,
    progress: Progress | None = None,
) -> CalibrateSummary:
    with using_threads(options.threads):
        return _calibrate(model_dir, out, options, progress)


def _calibrate(
    model_dir: Path, out: Path, options: CalibrateOptions, progress: Progress | None
) -> CalibrateSummary:
    if options.ctx is not None:
        check_tokens(options.tokens, options.ctx)
    _check_out(out, model_dir, options)
    device = resolve_device(options.device)
    started = perf_counter()
    found, config = float_source(model_dir, MODEL)
    kind, architecture = kind_of(config)
    arch = IMATRIX_ARCHS.get(str(config.get("model_type")))
    if kind != CAUSAL_LM or arch is None:
        raise InputError(
            model_dir, f"calibrate runs the Llama family ({', '.join(IMATRIX_ARCHS)}), not "
            f"{architecture} (model_type {config.get('model_type')!r})",
        )  # fmt: skip
    checkpoint, hf_config, tokenizer = float_parts(found, config, model_dir, MODEL)
    ctx = window_length(options.ctx, hf_config, model_dir, MODEL, shortest=1)
    check_tokens(options.tokens, ctx)
    check_activations(options.tokens // ctx * ctx, int(hf_config.hidden_size))
    texts = [load_text(p, tokenizer) for p in options.texts] or [default_text()]
    sources = take_windows(texts, tokenizer, options.tokens, ctx)
    model = empty_model(kind, config, hf_config, checkpoint, model_dir).eval()
    windows = interleaved(sources)
    check_vocabulary(windows, model.get_input_embeddings().num_embeddings, tokenizer)
    reader = open_reader(found)
    loaded = perf_counter()
    try:
        blocks = int(hf_config.num_hidden_layers)
        whole = None if progress is None else WholeModel(progress, blocks)
        if whole is not None:
            whole.start(len(windows) * ctx * blocks)
        stats = run_blocks(model, reader, windows, device, model_dir, whole)
        measured = sensitivity_of(model, reader, windows, device, model_dir, stats,
                                  options.sensitivity_tokens, whole)  # fmt: skip
        reader.check_unchanged()
    finally:
        reader.close()
    done = perf_counter()
    imatrix = _named(stats, arch, hf_config.num_hidden_layers, ctx, sources, model_dir)
    _warn_unrouted(imatrix)
    extra = _provenance([_info(s) for s in sources]) | measured.keys(
        llama_names(arch, hf_config.num_hidden_layers, [*stats, *measured.found])
    )
    write_imatrix(out, imatrix, extra)
    hidden = int(hf_config.hidden_size)
    return CalibrateSummary(
        model=str(model_dir),
        output=str(out),
        architecture=architecture,
        datasets=tuple(_info(s) for s in sources),
        ctx=ctx,
        windows=len(windows),
        tokens=len(windows) * ctx,
        entries=len(imatrix.entries),
        blocks=int(hf_config.num_hidden_layers),
        device=str(device),
        load_seconds=loaded - started,
        run_seconds=done - loaded - measured.seconds,
        peak_block_bytes=_block_bytes(model),
        activation_bytes=len(windows) * ctx * hidden * 4,
        sensitivity=measured.summary(),
    )


class WholeModel:
    """The block passes count a window's tokens at every block they pass; the bar counts tokens
    through the whole model (one per `blocks` token-blocks), so that its tokens/s is the summary
    line's. Integers throughout: the carry keeps the total exact."""

    def __init__(self, progress: Progress, blocks: int) -> None:
        self._progress, self._blocks = progress, max(1, blocks)
        self._done = self._shown = 0

    def start(self, total_bytes: int) -> None:
        self._done = self._shown = 0
        self._progress.start(total_bytes // self._blocks)

    def advance(self, name: str, nbytes: int) -> None:
        self._done += nbytes
        step = self._done // self._blocks - self._shown
        self._shown += step
        self._progress.advance(name, step)


def check_tokens(tokens: int, ctx: int) -> None:
    if ctx < 1:
        raise UsageError(None, f"a window of {ctx} tokens holds nothing; give 1 or more")
    if tokens < ctx:
        fill = "token does" if tokens == 1 else "tokens do"
        raise UsageError(
            None, f"{tokens} {fill} not fill one window of {ctx}; ask for at least {ctx}"
        )


def check_activations(tokens: int, hidden: int) -> None:
    held = tokens * hidden * 4
    if held > MAX_ACTIVATION_BYTES:
        limit = MAX_ACTIVATION_BYTES // (hidden * 4)
        raise UsageError(
            None, f"{tokens:,} tokens of hidden size {hidden} need {held / (1 << 30):.1f} GiB of "
            f"activations, over qtool's {MAX_ACTIVATION_BYTES >> 30} GiB; ask for at most "
            f"{limit:,} tokens per run and merge the runs' files",
        )  # fmt: skip


def interleaved(sources: list[Source]) -> list[list[int]]:
    """The windows of every source in turn (one of each, then the next of each ...)."""
    out = []
    longest = max(len(s.windows) for s in sources)
    for i in range(longest):
        out += [s.windows[i] for s in sources if i < len(s.windows)]
    return out


def _named(
    stats: dict[str, MatrixStats], arch: str, blocks: int, ctx: int, sources: list[Source],
    path: Path,
) -> ImportanceMatrix:  # fmt: skip
    names = llama_names(arch, blocks, list(stats))
    missing = [n for n in stats if n not in names]
    if missing:
        raise InputError(path, f"llama.cpp has no name for this {arch} weight; calibrate "
                         "cannot key its statistics", missing[0])  # fmt: skip
    top = max(int(s.counts.max()) for s in stats.values())
    datasets = tuple(s.name for s in sources)
    entries = {names[n]: s for n, s in stats.items()}
    return ImportanceMatrix(entries, ctx, min(top // ctx, MAX_CHUNK_COUNT), datasets)


def _info(source: Source) -> DatasetInfo:
    return DatasetInfo(source.name, source.sha256, source.tokens)


def _provenance(infos: Sequence[DatasetInfo]) -> dict[str, GGUFValue]:
    """qtool's keys, one item per dataset, when every dataset has them (else none)."""
    if not infos or any(i.sha256 is None or i.tokens is None for i in infos):
        return {}
    shas = tuple(str(i.sha256) for i in infos)
    tokens = np.array([i.tokens for i in infos], dtype=np.uint64)
    return {
        SHA_KEY: GGUFValue(ValueType.ARRAY, shas, ValueType.STRING),
        TOKENS_KEY: GGUFValue(ValueType.ARRAY, tokens, ValueType.UINT64),
    }


def _block_bytes(model: Any) -> int:
    base = getattr(model, getattr(model, "base_model_prefix", "") or "model")
    return max(sum(int(p.numel()) * 4 for p in block.parameters()) for block in base.layers)


class UnroutedExperts(UserWarning):
    """Experts the calibration text never routed a token to (count 0)."""


def _warn_unrouted(imatrix: ImportanceMatrix, shown: int = 4) -> None:
    """Name the experts of count 0, as llama-imatrix warns of its 'partial data': quantize gives
    them 1.0 on every column (llama-quantize's choice), the text telling nothing of them. The
    stacked gate, up and down of a block share one routing: counted once per block."""
    idle: dict[str, set[int]] = {}
    experts = 0
    for name, stats in imatrix.entries.items():
        if len(stats.counts) > 1:  # a stacked expert weight: one row per expert
            block = name.split(".ffn_")[0]
            experts = max(experts, len(stats.counts))
            idle.setdefault(block, set()).update(int(e) for e in np.flatnonzero(stats.counts == 0))
    blocks = sorted((b for b in idle if idle[b]), key=lambda b: (len(b), b))
    if not blocks:
        return
    total = sum(len(idle[b]) for b in blocks)
    where = "; ".join(_idle_experts(b, sorted(idle[b])) for b in blocks[:shown])
    more = f"; {len(blocks) - shown} more blocks" if len(blocks) > shown else ""
    warnings.warn(
        f"the calibration text never reached {total} of {experts * len(idle)} experts "
        f"({where}{more}): their count is 0, so quantize weighs them 1.0 on every column, "
        "as llama-quantize does; more text routes tokens to them",
        UnroutedExperts, stacklevel=2,
    )  # fmt: skip


def _idle_experts(block: str, experts: list[int]) -> str:
    noun = "expert" if len(experts) == 1 else "experts"
    return f"{block} {noun} {', '.join(map(str, experts))}"


class MergedTwice(UserWarning):
    """One file given twice to a merge (by inode: a link or another spelling of its path)."""


def _warn_same_file(inputs: Sequence[Path]) -> None:
    seen: dict[tuple[int, int], Path] = {}
    for path in inputs:
        st = path.stat()
        first = seen.setdefault((st.st_dev, st.st_ino), path)
        if first is not path:
            warnings.warn(
                f"{first} and {path} are the same file, merged twice: its counts count double",
                MergedTwice, stacklevel=2,
            )  # fmt: skip


def _check_out(out: Path, model_dir: Path, options: CalibrateOptions) -> None:
    """The output is never inside the model's directory nor one of its files (compared by
    device and inode: a weight file linked from elsewhere included), nor a text read."""
    refuse_nesting(out, [model_dir])
    try:
        files = list(model_dir.iterdir()) if model_dir.is_dir() else []
    except OSError:
        files = []  # unreadable: the model's own read says so
    check_files([out], [model_dir, *files, *options.texts], options.force)


def merge_files(inputs: Sequence[Path], out: Path, force: bool) -> MergeSummary:
    """The importance matrices in `inputs` (GGUF or legacy .dat) added together into `out`, as
    llama-imatrix --in-file A --in-file B ... writes them."""
    if len(inputs) < 2:
        raise UsageError(None, "a merge needs two or more importance matrices")
    check_files([out], list(inputs), force)
    _warn_same_file(inputs)
    files = [read_imatrix_file(p, digest=False) for p in inputs]
    matrices = [f.imatrix for f in files]
    per_file = [(p, dataset_infos(p, f.metadata, f.imatrix.datasets))
                for p, f in zip(inputs, files, strict=True)]  # fmt: skip
    warn_same_text(per_file, skip=1)
    infos = [info for _, ds in per_file for info in ds]
    joined = matrices[0]
    for i, matrix in enumerate(matrices[1:], 1):  # one at a time: a conflict names its file
        try:
            joined = merge(joined, matrix)
        except ValueError as err:
            before = inputs[0] if i == 1 else f"{inputs[0]} .. {inputs[i - 1]}"
            raise InputError(
                inputs[i], f"cannot be merged with {before}: {err}; merge only files "
                "calibrated on the same model with the same window length",
            ) from None  # fmt: skip
    alphas = merged(
        {p: read_sensitivities(p, f.metadata) for p, f in zip(inputs, files, strict=True)}
    )
    keys = sensitivity_keys(alphas) if alphas is not None else {}
    write_imatrix(out, joined, _provenance(infos) | keys)
    return MergeSummary(
        tuple(str(p) for p in inputs), str(out), tuple(infos), len(joined.entries),
        joined.chunk_size, joined.chunk_count,
    )  # fmt: skip
