"""Pictures for hunting the bad layer (matplotlib, the optional `plot` extra).

- plot_quantize / plot_compare: per-layer SQNR bars (outliers highlighted) above the error
  histograms of the worst layers, recomputed for those few tensors only; past MAX_BARS
  tensors, one bar per layer type at its worst tensor's SQNR (bar_groups).
- plot_tensor: one tensor's original, codes, reconstruction and error as heatmaps, with a
  histogram of its values and the representable range of the quantization grid marked.
Every PNG is FIGURE_PX pixels, passes the same output checks as any output (atomic.preflight:
never an input, its sidecar or the run's own outputs; --force to replace) and is written
atomically.
"""

from __future__ import annotations

import difflib
import io
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from qtool.engine.plan import QuantizeOptions, fitted_spec, plan_tensors
from qtool.engine.source import open_source, protected_paths
from qtool.errors import InputError, QtoolError
from qtool.formats.detect import detect
from qtool.io.atomic import preflight, write_file
from qtool.numerics import kernels
from qtool.numerics.packing import unpack_nibbles
from qtool.results import CompareSummary, QuantizeSummary, Row, natural_key
from qtool.spec import Codec, QSpec, as_grid

FIGURE_PX = (1400, 900)
DPI = 100
WORST = 3  # error histograms of the lowest SQNRs; red bars: at most this many outliers
OUTLIER_DB = 3.0  # a red bar's SQNR lies at least this far below the median (2x the error power)
MAX_SIDE = 256  # heatmaps show at most this many rows and columns (a strided sample)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise QtoolError(
            None, "plotting needs matplotlib; install it with: pip install 'qtool[plot]'"
        ) from None
    return plt


def _save(fig: Any, path: Path, protected: Iterable[Path], force: bool) -> None:
    """Render to memory, check the output again, then write atomically (never half a PNG)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    preflight([path], protected, force=force)
    write_file(path, buf.getvalue())


def _run_files(paths: Iterable[str]) -> list[Path]:
    """The files a run read or wrote: its inputs with their sidecars, its outputs, and the
    contents of a directory among them (a sharded checkpoint)."""
    files = protected_paths(Path(p) for p in paths)
    return files + [f for p in files if p.is_dir() for f in p.iterdir()]


def _figure(plt: Any, rows: int, cols: int) -> tuple[Any, Any]:
    size = (FIGURE_PX[0] / DPI, FIGURE_PX[1] / DPI)
    fig, axes = plt.subplots(rows, cols, figsize=size, dpi=DPI, squeeze=False)
    return fig, axes


def _worst(rows: Sequence[Row]) -> list[Row]:
    """The lowest SQNRs, -inf (all error) first; exact tensors are never among them."""
    scored = [r for r in rows if r.errors is not None and r.errors.sqnr_db != math.inf]
    return sorted(scored, key=lambda r: r.errors.sqnr_db if r.errors else 0.0)[:WORST]


def _outliers(rows: Sequence[Row]) -> list[Row]:
    """The bars painted red: of the WORST lowest SQNRs, those at least OUTLIER_DB below the
    median SQNR of the measured tensors (so four similar layers get no red bar, never three of
    four); -inf (all error) always counts."""
    sqnr = [r.errors.sqnr_db for r in rows if r.errors is not None]
    if not sqnr:
        return []
    median = statistics.median_low(sqnr)
    return [r for r in _worst(rows) if r.errors and r.errors.sqnr_db <= median - OUTLIER_DB]


def short_label(name: str, width: int = 36) -> str:
    """A tick label that keeps both ends of a long name (the layer index sits at the front,
    the parameter at the back): the middle is cut."""
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    index = re.search(r"\d+", name)  # the first number is usually the layer: keep it whole
    if index is not None and head < index.end() <= width - 9:
        head = index.end()
    return name[:head] + "…" + name[len(name) - (width - 1 - head) :]


MAX_BARS = 64  # more measured tensors than this: one bar per layer type (SmolLM2: 211 -> 9)


def bar_groups(measured: Sequence[Row]) -> list[tuple[str, list[Row]]]:
    """The chart's bars, each a label and its tensors: one per tensor, or, past MAX_BARS, one
    per layer type (the name with its numbers as `*`: `model.layers.*.mlp.up_proj.weight`),
    unless even those are more than MAX_BARS."""
    if len(measured) <= MAX_BARS:
        return [(r.name, [r]) for r in measured]
    groups: dict[str, list[Row]] = {}
    for r in measured:
        groups.setdefault(re.sub(r"\d+", "*", r.name), []).append(r)
    if len(groups) > MAX_BARS:
        return [(r.name, [r]) for r in measured]
    return [(f"{k} ×{len(v)}" if len(v) > 1 else v[0].name, v) for k, v in groups.items()]


def _sqnr_bars(ax: Any, rows: Sequence[Row], title: str, min_sqnr: float | None) -> None:
    """One bar per measured tensor at its SQNR, or per layer type at its worst tensor's
    (bar_groups); exact (+inf) and all-wrong (-inf) tensors get markers instead of a bar of
    made-up height; the gate's bound is a dashed line."""
    measured = sorted((r for r in rows if r.errors is not None), key=lambda r: natural_key(r.name))
    groups = bar_groups(measured)
    if len(groups) < len(measured):
        title += f" (worst of each layer type: {len(measured)} tensors, {len(groups)} bars)"
    sqnr = [min(r.errors.sqnr_db if r.errors else math.nan for r in g) for _, g in groups]
    outliers = {r.name for r in _outliers(measured)}
    worst = {label for label, g in groups if any(r.name in outliers for r in g)}
    finite = [v for v in sqnr if math.isfinite(v)]
    top = max([*finite, *([min_sqnr] if min_sqnr is not None else []), 0.0]) + 5
    bottom = min([*finite, 0.0])
    xs = range(len(groups))
    heights = [v if math.isfinite(v) else 0.0 for v in sqnr]
    colors = [_WORST_COLOR if label in worst else _BAR_COLOR for label, _ in groups]
    ax.bar(xs, heights, color=colors)
    handles = [_patch(_BAR_COLOR, "SQNR")]
    if worst:
        handles.insert(0, _patch(_WORST_COLOR, f"{OUTLIER_DB:g}+ dB below the median"))
    for value, marker, color, label, y in (
        (math.inf, "^", "#2ca02c", "exact (error 0)", top),
        (-math.inf, "v", "black", "-inf (B all wrong, or A all zero)", bottom),
    ):
        at = [i for i, v in enumerate(sqnr) if v == value]
        if at:
            handles.append(ax.scatter(at, [y] * len(at), marker=marker, color=color, s=30,
                                      clip_on=False, zorder=3, label=label))  # fmt: skip
    if min_sqnr is not None:
        handles.append(ax.axhline(min_sqnr, color=_WORST_COLOR, linestyle="--", linewidth=1,
                                  label=f"gate --min-sqnr {min_sqnr:g} dB"))  # fmt: skip
    ax.set_ylim(bottom, top)
    ax.set_title(title, loc="left")
    ax.set_ylabel("SQNR (dB), higher is better")
    ax.legend(handles=handles, fontsize=8, loc="lower right", bbox_to_anchor=(1.0, 1.0),
              ncol=len(handles), frameon=False)  # fmt: skip
    _bar_labels(ax, [label for label, _ in groups])


_BAR_COLOR, _WORST_COLOR = "#1f77b4", "#d62728"
MAX_LABELS = 150  # beyond this many bars, every k-th is labelled (the rest would overlap)


def _patch(color: str, label: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(color=color, label=label)


def _bar_labels(ax: Any, names: list[str]) -> None:
    step = max(1, math.ceil(len(names) / MAX_LABELS))
    ticks = list(range(0, len(names), step))
    ax.set_xticks(ticks)
    width = 56 if len(ticks) <= 20 else 36  # few bars (layer types): room for whole names
    ax.set_xticklabels([short_label(names[i], width) for i in ticks], rotation=90,
                       fontsize=7 if len(ticks) <= 60 else 5)  # fmt: skip
    ax.set_xlim(-0.6, len(names) - 0.4)


def _error_histograms(axes: list[Any], pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Log counts, so the few large errors that hurt SQNR are visible beside the bulk."""
    for ax, (name, (x, y)) in zip(axes, pairs.items(), strict=False):
        err = (x.float() - y.float()).reshape(-1)
        ax.hist(err.numpy(), bins=101, color=_WORST_COLOR)
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.7)  # from a count of 1, so single outliers show beside the bulk
        ax.set_title(f"error of {short_label(name, 48)}", fontsize=9)
        ax.set_xlabel("x - x_hat")
        ax.set_ylabel("count (log)")
        ax.locator_params(axis="x", nbins=5)  # small errors have long tick labels
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
    for ax in axes[len(pairs) :]:
        ax.axis("off")


def plot_quantize(
    summary: QuantizeSummary,
    options: QuantizeOptions,
    path: Path,
    min_sqnr: float | None = None,
    *,
    force: bool = False,
) -> None:
    """SQNR of every quantized layer and the error histograms of the worst ones."""
    plt = _pyplot()
    worst = _worst(summary.rows)
    if not worst and not any(r.errors for r in summary.rows):
        raise QtoolError(
            path, "no error figures to plot: a plain dry run measures nothing", hint="estimate"
        )
    pairs = _requantize(Path(summary.inputs[0]), [r.name for r in worst], options)
    fig, axes = _figure(plt, 2, WORST)
    grid = axes[0, 0].get_gridspec()
    for ax in axes[0]:
        ax.remove()
    title = f"{summary.spec.describe()}: SQNR per layer"
    _sqnr_bars(fig.add_subplot(grid[0, :]), summary.rows, title, min_sqnr)
    _error_histograms(list(axes[1]), pairs)
    fig.tight_layout()
    _save(fig, path, _run_files([*summary.inputs, *summary.outputs]), force)
    plt.close(fig)


def plot_compare(
    summary: CompareSummary, path: Path, min_sqnr: float | None = None, *, force: bool = False
) -> None:
    plt = _pyplot()
    pairs = _compared_values(summary, [r.name for r in _worst(summary.rows)])
    fig, axes = _figure(plt, 2, WORST)
    grid = axes[0, 0].get_gridspec()
    for ax in axes[0]:
        ax.remove()
    _sqnr_bars(fig.add_subplot(grid[0, :]), summary.rows, "A vs B: SQNR per tensor", min_sqnr)
    _error_histograms(list(axes[1]), pairs)
    fig.tight_layout()
    _save(fig, path, _run_files(summary.inputs), force)
    plt.close(fig)


def _compared_values(
    summary: CompareSummary, names: list[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) of some compared tensors as float32, read as the comparison read them (a GGUF
    file against a Hugging Face checkpoint: under the latter's names)."""
    from qtool.engine.compare import open_pair

    left, right, _ = open_pair(Path(summary.inputs[0]), Path(summary.inputs[1]))
    try:
        return {n: (left.values(n).float().clone(), right.values(n).float().clone()) for n in names}
    finally:
        left.close()
        right.close()


def _requantize(
    src: Path, names: list[str], options: QuantizeOptions
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(x, x_hat) of a few tensors, quantized again exactly as the run did."""
    source = open_source(src)  # a file, a sharded checkpoint or a model directory
    out = {}
    for name in names:
        path = source.shard_holding(name)
        assert path is not None  # the run's own rows name its tensors
        ckpt = source.checkpoint(path)
        try:
            entry = ckpt.by_name()[name]
            spec = plan_tensors(path, (entry,), options)[0].spec
            if spec is not None:
                x = ckpt.tensor(entry).clone()
                out[name] = (x.float(), _roundtrip(x, spec))
        finally:
            ckpt.close()
    return out


def _roundtrip(x: torch.Tensor, spec: Codec) -> torch.Tensor:
    """x_hat as restored (x's own dtype; a GGUF type as ggml dequantizes it), as float32."""
    from qtool.numerics.kernels import restored

    return restored(x, spec)


def _refuse_quantized(path: Path) -> None:
    """plot quantizes a float tensor: a quantized file holds codes, not the values to draw."""
    found = detect(path)
    if found.quantized:
        raise InputError(
            path,
            f"is {found.description}, not a float checkpoint: plot draws a float tensor "
            "quantized; give the original float checkpoint (or `qtool compare ORIGINAL "
            "QUANTIZED --plot FILE.png` for the errors of this one)",
        )


def _no_such_tensor(tensor: str, entries: Iterable[str]) -> str:
    """The no-such-tensor message, with the closest names when the name looks mistyped."""
    close = difflib.get_close_matches(tensor, list(entries), n=3)
    if close:
        return f"no such tensor; did you mean {' or '.join(close)}? (qtool inspect lists them)"
    return "no such tensor; list them with qtool inspect"


def default_tensor_plot_path(checkpoint: Path, tensor: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", tensor)[:100]
    return checkpoint.with_name(f"{checkpoint.stem}.{safe}.png")


def plot_tensor(
    checkpoint: Path, tensor: str, spec: Codec, path: Path, *, force: bool = False
) -> dict[str, object]:
    """Heatmaps and a value histogram of one tensor; returns what was drawn (for reports)."""
    protected = protected_paths([checkpoint])
    preflight([path], protected, force=force)
    plt = _pyplot()
    _refuse_quantized(checkpoint)
    source = open_source(checkpoint)
    shard = source.shard_holding(tensor)
    if shard is None:
        assert source.index is not None  # a lone file holds every name it is asked for
        names = source.index.weight_map
        raise QtoolError(checkpoint, _no_such_tensor(tensor, names), tensor)
    ckpt = source.checkpoint(shard)
    try:
        entry = ckpt.by_name().get(tensor)
        if entry is None:
            raise QtoolError(checkpoint, _no_such_tensor(tensor, ckpt.by_name()), tensor)
        x = ckpt.tensor(entry)
        if not x.is_floating_point() or x.ndim == 0 or x.numel() == 0:
            raise QtoolError(checkpoint, "only non-empty float tensors can be plotted", tensor)
        x = x.clone()  # its own dtype: the figures measure x_hat as restored to it
    finally:
        ckpt.close()
    spec = as_grid(fitted_spec(checkpoint, entry, spec))  # the CLI asks for grids only
    try:
        result = kernels.quantize_tensor(x, spec)
    except ValueError as err:  # NaN/Inf, or a range beyond float32
        raise QtoolError(checkpoint, f"cannot be quantized: {err}", tensor) from None
    q, scale, zp = result.q, result.scale, result.zero_point
    x_hat = kernels.dequantize(q, scale, zp, spec, dtype=x.dtype, shape=x.shape).float()
    x = x.float()
    codes = (
        unpack_nibbles(result.q, x.shape[-1], spec.dtype.signed) if spec.dtype.packed else result.q
    )
    fig, axes = _figure(plt, 2, 3)
    panels = [
        ("original", x, "RdBu_r"),
        ("integer codes", codes.float(), "viridis"),
        ("reconstruction", x_hat, "RdBu_r"),
        ("error x - x_hat", x - x_hat, "PuOr"),
    ]
    for ax, (title, values, cmap) in zip(axes.flat, panels, strict=False):
        _heatmap(fig, ax, values, title, cmap)
    _value_histogram(axes[1, 1], x, result, spec)
    stats = result.errors
    assert stats is not None
    parts = [
        tensor,
        f"{list(x.shape)} {entry.dtype}",
        spec.describe(),
        f"MSE {stats.mse:.3g}",
        f"max |err| {stats.max_abs:.3g}",
        f"SQNR {stats.sqnr_db:.1f} dB",
    ]
    if result.scale.ndim == 2:  # groups: where each row's scales jump (outlier groups)
        _heatmap(fig, axes[1, 2], result.scale, "scale of each group (row x group)", "magma")
    else:
        axes[1, 2].axis("off")
        axes[1, 2].text(0.0, 1.0, "\n".join(parts), va="top", family="monospace")
    fig.suptitle("  ·  ".join(parts), fontsize=10)
    fig.tight_layout()
    _save(fig, path, protected, force)
    plt.close(fig)
    return {
        "tensor": tensor,
        "spec": spec.describe(),
        "qspec": spec,
        "mse": stats.mse,
        "max_abs_error": stats.max_abs,
        "sqnr_db": stats.sqnr_db,
    }


def _heatmap(fig: Any, ax: Any, values: torch.Tensor, title: str, cmap: str) -> None:
    """The tensor as [dim 0, the rest]; a large one is shown as blocks holding their largest
    |value| (so an outlier channel is never sampled away), with axes in true indices."""
    grid = values.reshape(values.shape[0], -1) if values.ndim > 1 else values.reshape(1, -1)
    rows, cols = grid.shape
    step_r, step_c = max(1, math.ceil(rows / MAX_SIDE)), max(1, math.ceil(cols / MAX_SIDE))
    shown = block_extreme(grid, step_r, step_c).numpy()
    limits: dict[str, float] = {}
    if cmap in ("RdBu_r", "PuOr"):  # diverging maps: keep 0 at the neutral colour
        bound = float(abs(shown).max()) or 1.0
        limits = {"vmin": -bound, "vmax": bound}
    extent = (-0.5, shown.shape[1] * step_c - 0.5, shown.shape[0] * step_r - 0.5, -0.5)
    image = ax.imshow(shown, cmap=cmap, aspect="auto", interpolation="nearest", extent=extent,
                      **limits)  # fmt: skip
    fig.colorbar(image, ax=ax, fraction=0.046)
    pooled = f" (largest |value| per {step_r}x{step_c} block)" if step_r * step_c > 1 else ""
    ax.set_title(title + pooled, fontsize=10)
    ax.set_ylabel("index along dim 0", fontsize=8)
    ax.set_xlabel("index along the other dims (flattened)", fontsize=8)


def block_extreme(grid: torch.Tensor, step_r: int, step_c: int) -> torch.Tensor:
    """[R, C] -> [ceil(R/step_r), ceil(C/step_c)]: each block's value of largest magnitude."""
    rows, cols = grid.shape
    n_r, n_c = math.ceil(rows / step_r), math.ceil(cols / step_c)
    padded = torch.zeros(n_r * step_r, n_c * step_c, dtype=grid.dtype)
    padded[:rows, :cols] = grid
    blocks = padded.reshape(n_r, step_r, n_c, step_c).permute(0, 2, 1, 3).reshape(n_r, n_c, -1)
    pick = blocks.abs().argmax(dim=-1, keepdim=True)  # [n_r, n_c, 1]
    return blocks.gather(-1, pick).squeeze(-1)


def _value_histogram(
    ax: Any, x: torch.Tensor, result: kernels.QuantizedTensor, spec: QSpec
) -> None:
    """Where the values lie and what the grid can represent: per tensor one range, per
    channel the narrowest and widest of the channels' ranges."""
    ax.hist(x.reshape(-1).numpy(), bins=121, color="#7f7f7f")
    ax.set_yscale("log")
    low = (spec.qmin - result.zero_point.float()) * result.scale
    high = (spec.qmax - result.zero_point.float()) * result.scale
    widest = (float(low.min()), float(high.max()))
    ax.axvline(widest[0], color="#d62728", linestyle="--", label="representable range")
    ax.axvline(widest[1], color="#d62728", linestyle="--")
    if low.numel() > 1:
        low, high = low.reshape(-1), high.reshape(-1)
        narrow = int((high - low).argmin())
        ax.axvspan(float(low[narrow]), float(high[narrow]), color="#2ca02c", alpha=0.2,
                   label="narrowest group's range")  # fmt: skip
    if spec.dtype.bits == 4:  # sixteen levels: draw the grid of the widest group itself
        widest_group = int((high - low).reshape(-1).argmax())
        step = float(result.scale.reshape(-1)[widest_group])
        zero = float(result.zero_point.reshape(-1)[widest_group])
        for level in range(spec.qmin, spec.qmax + 1):
            label = "4-bit grid (widest group)" if level == spec.qmin else None
            ax.axvline(
                (level - zero) * step, color="#1f77b4", linewidth=0.6, alpha=0.7, label=label
            )
    ax.axvline(0.0, color="black", linewidth=0.5)
    ax.set_title("values and the quantization grid's range", fontsize=10)
    ax.legend(fontsize=8)
