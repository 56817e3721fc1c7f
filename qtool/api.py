"""The one entry point the CLI and tests call: plan, quantize, dequantize, compare, inspect, plot.

It decides between a single file and a sharded checkpoint, so the engine modules never import
each other in a circle. Engine modules that import torch are imported inside the functions:
`qtool --help`, `inspect` and header-only dry runs never pay for torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qtool.engine.plan import QuantizeOptions
from qtool.io.index import is_sharded

if TYPE_CHECKING:
    from qtool.results import (
        CompareSummary,
        DequantizeSummary,
        InspectSummary,
        Progress,
        QuantizeSummary,
    )
    from qtool.spec import QSpec

__all__ = [
    "QuantizeOptions",
    "compare",
    "dequantize",
    "inspect",
    "plan",
    "plot_compare",
    "plot_quantize",
    "plot_tensor",
    "quantize",
]


def plan(src: Path, out: Path | None, options: QuantizeOptions) -> QuantizeSummary | None:
    """The plan from headers alone (torch-free); None for a torch pickle, which must be loaded."""
    from qtool.engine.plan import dry_run

    return dry_run(src, out, options)


def quantize(
    src: Path,
    out: Path | None,
    options: QuantizeOptions,
    *,
    device: str = "auto",
    force: bool = False,
    dry_run: bool = False,
    estimate: bool = False,
    progress: Progress | None = None,
) -> QuantizeSummary:
    """Quantize a checkpoint file, or a sharded checkpoint (its index file or directory)."""
    if is_sharded(src):
        from qtool.engine.sharded import quantize_sharded

        run = quantize_sharded
    else:
        from qtool.engine.run import quantize_file

        run = quantize_file
    return run(
        src,
        out,
        options,
        device=device,
        force=force,
        dry_run=dry_run,
        estimate=estimate,
        progress=progress,
    )


def dequantize(
    src: Path,
    out: Path | None,
    *,
    qparams: Path | None = None,
    dtype: str = "original",
    force: bool = False,
) -> DequantizeSummary:
    """Dequantize a quantized file, or a quantized sharded checkpoint."""
    if is_sharded(src):
        from qtool.engine.sharded import dequantize_sharded

        return dequantize_sharded(src, out, dtype=dtype, force=force)
    from qtool.engine.restore import dequantize_file

    return dequantize_file(src, out, qparams=qparams, dtype=dtype, force=force)


def compare(a: Path, b: Path) -> CompareSummary:
    """Per-tensor error of B against the reference A (quantized sides dequantized on the fly)."""
    from qtool.engine.compare import compare_files

    return compare_files(a, b)


def inspect(path: Path) -> InspectSummary:
    """What a checkpoint, quantized file, sidecar or sharded set holds (torch-free for
    safetensors)."""
    from qtool.engine.inspect import inspect_path

    return inspect_path(path)


def plot_quantize(summary: QuantizeSummary, options: QuantizeOptions, path: Path) -> None:
    from qtool.engine import plots

    plots.plot_quantize(summary, options, path)


def plot_compare(summary: CompareSummary, path: Path) -> None:
    from qtool.engine import plots

    plots.plot_compare(summary, path)


def default_tensor_plot_path(checkpoint: Path, tensor: str) -> Path:
    from qtool.engine.plots import default_tensor_plot_path as default

    return default(checkpoint, tensor)


def plot_tensor(checkpoint: Path, tensor: str, spec: QSpec, path: Path) -> dict[str, object]:
    from qtool.engine import plots

    return plots.plot_tensor(checkpoint, tensor, spec, path)
