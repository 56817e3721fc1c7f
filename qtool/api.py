"""The one entry point the CLI and tests call: plan, quantize, dequantize, compare, inspect, plot.

The engine runs single files, sharded checkpoints and model directories through one loop (a
file is a one-shard source); formats/detect.py says what a path holds, for every command.
Engine modules that import torch are imported inside the functions: `qtool --help`, `inspect`
and header-only dry runs never pay for torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qtool.calibrate_results import CalibrateSummary, MergeSummary
    from qtool.engine.evaluate.run import EvalOptions
    from qtool.engine.job import Mode
    from qtool.engine.plan import QuantizeOptions
    from qtool.eval_results import EvalSummary, FloatPass
    from qtool.formats.registry import Refusal
    from qtool.numerics.allocate import Target as AllocationTarget
    from qtool.recipe.rules import Recipe, Rule
    from qtool.results import (
        CompareSummary,
        DequantizeSummary,
        InspectSummary,
        Progress,
        QuantizeSummary,
    )
    from qtool.spec import Codec

__all__ = [
    "AllocationTarget",
    "EvalOptions",
    "Mode",
    "calibrate",
    "merge_imatrices",
    "QuantizeOptions",
    "compare",
    "dequantize",
    "evaluate",
    "evaluate_all",
    "eval_inputs",
    "eval_kind",
    "inspect",
    "plot_compare",
    "plot_quantize",
    "check_outputs",
    "one_command",
    "output_path",
    "unmatched_globs",
    "load_recipe",
    "unmatched_rules",
    "plot_tensor",
    "format_option_refusal",
    "format_refuses",
    "output_formats",
    "quantize",
    "quantized_gguf",
]


def __getattr__(name: str) -> object:
    """QuantizeOptions and Mode on first use: `inspect` does not load the planner."""
    if name == "QuantizeOptions":
        from qtool.engine.plan import QuantizeOptions

        return QuantizeOptions
    if name == "AllocationTarget":
        from qtool.numerics.allocate import Target

        return Target
    if name == "EvalOptions":
        from qtool.engine.evaluate.run import EvalOptions

        return EvalOptions
    if name == "Mode":
        from qtool.engine.job import Mode

        return Mode
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def quantize(
    src: Path,
    out: Path | None,
    options: QuantizeOptions,
    *,
    mode: Mode | str = "write",
    device: str = "auto",
    force: bool = False,
    progress: Progress | None = None,
    also: Sequence[Path] = (),
    threads: int | None = None,
    allow_requantize: bool = False,
) -> QuantizeSummary:
    """Quantize a checkpoint file, a sharded checkpoint (its index file or directory) or a
    model directory (a directory in gives a directory out, in every format); `mode` plan
    (from headers alone, torch-free for safetensors) or estimate (the figures, nothing
    written) for a dry run. `also`: files the caller writes afterwards
    (a plot), checked with the run's outputs. `threads`: torch's CPU threads for the run,
    set once its checks passed and given back at the end (None: the idle cores,
    engine/threads.py). `allow_requantize`: an already quantized GGUF is quantized again
    (engine/requantize.py) instead of refused."""
    from qtool.engine.hf_gguf import converts, quantize_hf
    from qtool.engine.job import Mode, RunOptions
    from qtool.engine.requantize import requantize
    from qtool.engine.run import quantize as run

    go = quantize_hf if converts(src, options) else requantize if allow_requantize else run
    return go(src, out, options, RunOptions(Mode(mode), device, force, progress, also, threads))


def quantized_gguf(src: Path) -> str | None:
    """What `src` is when it is an already quantized GGUF (None: anything else)."""
    from qtool.engine.requantize import quantized_gguf as found

    return found(src)


def dequantize(
    src: Path,
    out: Path | None,
    *,
    qparams: Path | None = None,
    dtype: str = "original",
    force: bool = False,
    progress: Progress | None = None,
) -> DequantizeSummary:
    """Dequantize a qtool-quantized file (a file out), or a directory of them or a
    compressed-tensors model directory (a float model directory out, or one file when `out`
    names a .safetensors/.pt file)."""
    from qtool.engine import restore

    return restore.dequantize(
        src, out, qparams=qparams, dtype=dtype, force=force, progress=progress
    )


def compare(
    a: Path, b: Path, pool: str = "quantized", progress: Progress | None = None
) -> CompareSummary:
    """Per-tensor error of B against the reference A (quantized sides dequantized on the fly);
    `pool`: what the overall figures pool, "quantized" (as quantize does) or "all"."""
    from qtool.engine.compare import compare_files

    return compare_files(a, b, pool, progress)


def evaluate(
    float_dir: Path, quant: Path, options: EvalOptions, progress: Progress | None = None
) -> EvalSummary:
    """FLOAT and QUANT run on the same tokens: perplexity, KL and top-1 agreement (causal LMs)
    or embedding cosine (encoders), and per-layer output error; needs the interop extra."""
    from qtool.engine.evaluate.run import evaluate as run

    return run(float_dir, quant, options, progress)


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
    """Every QUANT against one float pass (the float side from the logits file `logits`, when
    given, FLOAT's weights never read; every float log-probability written to `save_logits`,
    coded in 16 bits, when given, replacing an existing file only with `force`). `on_float`
    is told what the float side was measured on and its perplexity, once it is known."""
    from qtool.engine.evaluate.many import evaluate_all as run

    return run(float_dir, quants, options, progress, logits, save_logits, force, on_float)


def eval_inputs(
    logits: Path | None, text: Path | None, tokens: int | None, ctx: int | None, dtype: str | None
) -> tuple[Path | None, int, int | None, str]:
    """eval's text, tokens, ctx and dtype: those given, the rest from the logits file when one
    is given (a given value that differs from the file's is refused when it is read), else
    the defaults (the default text, 4096 tokens, FLOAT's ctx, float32)."""
    from qtool.engine.evaluate.many import saved_defaults

    return saved_defaults(logits, text, tokens, ctx, dtype)


def calibrate(
    model_dir: Path,
    out: Path,
    texts: Sequence[Path] = (),
    tokens: int = 128 * 512,
    ctx: int | None = None,
    device: str = "cpu",
    force: bool = False,
    threads: int | None = None,
    progress: Progress | None = None,
    sensitivity_tokens: int = 0,
) -> CalibrateSummary:
    """The importance matrix of a float model (Llama family) over calibration text, run one
    decoder block at a time, written to `out` as llama.cpp's GGUF imatrix; needs the interop
    extra. `sensitivity_tokens` > 0: also alpha per Linear, measured on that many of the
    tokens (engine/calibrate/sensitivity.py)."""
    from qtool.engine.calibrate.run import CalibrateOptions
    from qtool.engine.calibrate.run import calibrate as run

    options = CalibrateOptions(
        tuple(texts), tokens, ctx, device, force, threads, sensitivity_tokens
    )
    return run(model_dir, out, options, progress)


def merge_imatrices(inputs: Sequence[Path], out: Path, force: bool = False) -> MergeSummary:
    """Importance matrices (GGUF or legacy .dat) added together into one GGUF imatrix."""
    from qtool.engine.calibrate.run import merge_files

    return merge_files(inputs, out, force)


def eval_kind(float_dir: Path) -> str:
    """ "causal-lm" or "encoder", from FLOAT's config.json alone (torch-free)."""
    from qtool.engine.model.config import float_source, kind_of

    return kind_of(float_source(float_dir)[1])[0]


def inspect(path: Path) -> InspectSummary:
    """What a checkpoint, quantized file, sidecar or sharded set holds (torch-free for
    safetensors)."""
    from qtool.engine.inspect import inspect_path

    return inspect_path(path)


def plot_quantize(
    summary: QuantizeSummary,
    options: QuantizeOptions,
    path: Path,
    min_sqnr: float | None = None,
    *,
    force: bool = False,
) -> None:
    """Per-layer SQNR (a --min-sqnr line when given) and the worst layers' error histograms."""
    from qtool.engine import plots

    plots.plot_quantize(summary, options, path, min_sqnr, force=force)


def plot_compare(
    summary: CompareSummary, path: Path, min_sqnr: float | None = None, *, force: bool = False
) -> None:
    from qtool.engine import plots

    plots.plot_compare(summary, path, min_sqnr, force=force)


def output_path(
    out: Path | None, default: Path, accepted: tuple[str, ...], what: str, flag: str = "-o"
) -> Path:
    """The file an output option names: `default` when absent, the name when its extension
    is accepted, the default name inside an existing directory; UsageError otherwise."""
    from qtool.io.atomic import resolve_output

    return resolve_output(out, default, accepted, what, flag)


def unmatched_globs(names: list[str], patterns: tuple[str, ...]) -> list[str]:
    """The patterns that match none of `names` (a typo, or a glob for another model)."""
    from qtool.engine.plan import unmatched_globs as unmatched

    return unmatched(names, patterns)


def load_recipe(path: Path) -> Recipe:
    """Read and check a recipe file; RecipeError (a usage error) naming file, line and key."""
    from qtool.recipe.file import load_recipe as read_recipe

    return read_recipe(path)


def unmatched_rules(rules: Sequence[Rule], names: list[str]) -> list[Rule]:
    """The recipe rules whose pattern matches none of `names` (each worth a warning)."""
    from qtool.recipe.rules import unmatched

    return unmatched(rules, names)


def one_command() -> AbstractContextManager[None]:
    """Open around one command (its checks, its writes): the names its output checks reserve
    (free without --force, so never replaced at the commit) end with it."""
    from qtool.io.atomic import one_command as scope

    return scope()


def check_outputs(outputs: list[Path], inputs: list[Path], force: bool) -> None:
    """Refuse, before anything is read, outputs that would replace an input (or its sidecar),
    an existing file without `force`, or anything but a regular file."""
    from qtool.engine.layout import check_files

    check_files(outputs, inputs, force)


def default_tensor_plot_path(checkpoint: Path, tensor: str) -> Path:
    from qtool.engine.plots import default_tensor_plot_path as default

    return default(checkpoint, tensor)


def plot_tensor(
    checkpoint: Path, tensor: str, spec: Codec, path: Path, *, force: bool = False
) -> dict[str, object]:
    from qtool.engine import plots

    return plots.plot_tensor(checkpoint, tensor, spec, path, force=force)


def output_formats() -> list[tuple[str, str]]:
    """The formats `--format` writes, in order, each with its one-line help (the registry's:
    loads the format packages, torch-free)."""
    from qtool.formats import registry

    return [(e.name, e.help) for e in registry.outputs()]


def format_refuses(fmt: str, spec: Codec) -> Refusal | None:
    """Why the output format `fmt` can store no tensor at all with `spec` (compressed-tensors:
    unsigned codes, an axis other than the output channels), or None: checked before any file
    is read, so the CLI can report a usage error (the refusal's hint names what to change)."""
    from qtool.formats import registry

    return registry.spec_refusal(fmt, spec)


def format_option_refusal(fmt: str, *, config: bool, group_fallback: bool) -> Refusal | None:
    """Why the output format `fmt` takes no model config or group fallback (the format that
    reads a config takes both), or None."""
    from qtool.formats import registry

    return registry.option_refusal(fmt, config=config, group_fallback=group_fallback)
