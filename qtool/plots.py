"""Pictures for hunting the bad layer (matplotlib, the optional `plot` extra).

- plot_quantize / plot_compare: per-layer SQNR bars (the worst highlighted) above the error
  histograms of the worst layers, recomputed for those few tensors only.
- plot_tensor: one tensor's original, codes, reconstruction and error as heatmaps, with a
  histogram of its values and the representable range of the quantization grid marked.
Every PNG is FIGURE_PX pixels and written atomically.
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path
from typing import Any

import torch

from qtool import kernels
from qtool.atomic import OutputSet
from qtool.checkpoint import open_checkpoint
from qtool.errors import OutputError, QtoolError
from qtool.index import is_sharded, load_index
from qtool.plan import QuantizeOptions, plan_tensors
from qtool.spec import QSpec
from qtool.summary import CompareSummary, QuantizeSummary, TensorRow

FIGURE_PX = (1400, 900)
DPI = 100
WORST = 3
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


def _save(fig: Any, path: Path) -> None:
    """Render to memory, then write atomically (never a half-written PNG)."""
    if not path.parent.is_dir():
        raise OutputError(path, f"directory {path.parent} does not exist; create it first")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    with OutputSet() as outputs:
        outputs.create(path).write(buf.getvalue())
        outputs.commit()


def _figure(plt: Any, rows: int, cols: int) -> tuple[Any, Any]:
    size = (FIGURE_PX[0] / DPI, FIGURE_PX[1] / DPI)
    fig, axes = plt.subplots(rows, cols, figsize=size, dpi=DPI, squeeze=False)
    return fig, axes


def _worst(rows: list[TensorRow]) -> list[TensorRow]:
    """The lowest SQNRs, -inf (all error) first; exact tensors are never among them."""
    scored = [r for r in rows if r.errors is not None and r.errors.sqnr_db != math.inf]
    return sorted(scored, key=lambda r: r.errors.sqnr_db if r.errors else 0.0)[:WORST]


def _sqnr_bars(ax: Any, rows: list[TensorRow], title: str) -> None:
    """One bar per measured tensor. Exact (+inf) bars reach just above the best finite one,
    -inf bars reach just below the worst (and below 0), each labelled, so both stay visible."""
    measured = [r for r in rows if r.errors is not None]
    worst = {r.name for r in _worst(measured)}
    sqnrs = [r.errors.sqnr_db for r in measured if r.errors is not None]
    finite = [v for v in sqnrs if math.isfinite(v)]
    cap = (max(finite) if finite else 60.0) + 5
    floor = min([0.0, *finite]) - 5
    values = [min(max(v, floor), cap) for v in sqnrs]
    colors = ["#d62728" if r.name in worst else "#1f77b4" for r in measured]
    ax.bar(range(len(measured)), values, color=colors)
    ax.set_ylim(floor - 5 if -math.inf in sqnrs else min(0.0, floor + 5), cap + 5)
    ax.set_title(title)
    ax.set_ylabel("SQNR (dB), higher is better")
    ax.set_xticks(range(len(measured)))
    labels = [r.name if len(r.name) <= 28 else "…" + r.name[-27:] for r in measured]
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    for i, value in enumerate(sqnrs):
        if value == math.inf:
            ax.text(i, cap, "exact", ha="center", va="bottom", fontsize=7)
        elif value == -math.inf:
            ax.text(i, floor, "-inf", ha="center", va="top", fontsize=7, color="#d62728")


def _error_histograms(axes: list[Any], pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    for ax, (name, (x, y)) in zip(axes, pairs.items(), strict=False):
        err = (x.float() - y.float()).reshape(-1)
        ax.hist(err.numpy(), bins=101, color="#d62728")
        ax.set_title(f"error of {name[-40:]}", fontsize=9)
        ax.set_xlabel("x - x_hat")
    for ax in axes[len(pairs) :]:
        ax.axis("off")


def plot_quantize(summary: QuantizeSummary, options: QuantizeOptions, path: Path) -> None:
    """SQNR of every quantized layer and the error histograms of the worst ones."""
    plt = _pyplot()
    worst = _worst(summary.rows)
    if not worst and not any(r.errors for r in summary.rows):
        raise QtoolError(path, "no error figures to plot; drop --dry-run or add --estimate")
    pairs = _requantize(Path(summary.inputs[0]), [r.name for r in worst], options)
    fig, axes = _figure(plt, 2, WORST)
    grid = axes[0, 0].get_gridspec()
    for ax in axes[0]:
        ax.remove()
    _sqnr_bars(
        fig.add_subplot(grid[0, :]), summary.rows, f"{summary.spec.describe()}: SQNR per layer"
    )
    _error_histograms(list(axes[1]), pairs)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_compare(summary: CompareSummary, path: Path) -> None:
    from qtool.compare import FloatSource

    plt = _pyplot()
    worst = _worst(summary.rows)
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    a, b = FloatSource(Path(summary.inputs[0])), FloatSource(Path(summary.inputs[1]))
    try:
        for r in worst:
            pairs[r.name] = (a.values(r.name).float(), b.values(r.name).float())
    finally:
        a.close()
        b.close()
    fig, axes = _figure(plt, 2, WORST)
    grid = axes[0, 0].get_gridspec()
    for ax in axes[0]:
        ax.remove()
    _sqnr_bars(fig.add_subplot(grid[0, :]), summary.rows, "A vs B: SQNR per tensor")
    _error_histograms(list(axes[1]), pairs)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _requantize(
    src: Path, names: list[str], options: QuantizeOptions
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(x, x_hat) of a few tensors, quantized again exactly as the run did."""
    files: dict[str, Path] = {}
    if is_sharded(src):
        index = load_index(src)
        files = {n: index.directory / index.weight_map[n] for n in names}
    out = {}
    for name in names:
        path = files.get(name, src)
        ckpt = open_checkpoint(path)
        try:
            entry = ckpt.by_name()[name]
            spec = plan_tensors(path, (entry,), options)[0].spec
            if spec is not None:
                x = ckpt.tensor(entry).float()
                out[name] = (x, _roundtrip(x, spec))
        finally:
            ckpt.close()
    return out


def _roundtrip(x: torch.Tensor, spec: QSpec) -> torch.Tensor:
    result = kernels.quantize_tensor(x, spec, with_errors=False)
    return kernels.dequantize(result.q, result.scale, result.zero_point, spec.axis)


def default_tensor_plot_path(checkpoint: Path, tensor: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", tensor)[:100]
    return checkpoint.with_name(f"{checkpoint.stem}.{safe}.png")


def plot_tensor(checkpoint: Path, tensor: str, spec: QSpec, path: Path) -> dict[str, object]:
    """Heatmaps and a value histogram of one tensor; returns what was drawn (for reports)."""
    plt = _pyplot()
    ckpt = open_checkpoint(checkpoint)
    try:
        entry = ckpt.by_name().get(tensor)
        if entry is None:
            raise QtoolError(checkpoint, "no such tensor; list them with qtool inspect", tensor)
        x = ckpt.tensor(entry)
        if not x.is_floating_point() or x.ndim == 0 or x.numel() == 0:
            raise QtoolError(checkpoint, "only non-empty float tensors can be plotted", tensor)
        x = x.float().clone()
    finally:
        ckpt.close()
    axis = spec.axis
    if axis is not None and x.ndim < 2:
        spec = QSpec(spec.scheme, spec.dtype, None)
    elif axis is not None and not -x.ndim <= axis < x.ndim:
        raise QtoolError(checkpoint, f"--axis {axis} out of range", tensor)
    try:
        result = kernels.quantize_tensor(x, spec)
    except ValueError as err:  # NaN/Inf, or a range beyond float32
        raise QtoolError(checkpoint, f"cannot be quantized: {err}", tensor) from None
    x_hat = kernels.dequantize(result.q, result.scale, result.zero_point, spec.axis)
    fig, axes = _figure(plt, 2, 3)
    panels = [
        ("original", x, "RdBu_r"),
        ("integer codes", result.q.float(), "viridis"),
        ("reconstruction", x_hat, "RdBu_r"),
        ("error x - x_hat", x - x_hat, "PuOr"),
    ]
    for ax, (title, values, cmap) in zip(axes.flat, panels, strict=False):
        _heatmap(fig, ax, values, title, cmap)
    _value_histogram(axes[1, 1], x, result, spec)
    axes[1, 2].axis("off")
    stats = result.errors
    assert stats is not None
    text = (
        f"{tensor}\n{list(x.shape)} {entry.dtype}\n{spec.describe()}\n\n"
        f"MSE {stats.mse:.3g}\nmax |err| {stats.max_abs:.3g}\nSQNR {stats.sqnr_db:.1f} dB"
    )
    axes[1, 2].text(0.0, 1.0, text, va="top", family="monospace", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return {"tensor": tensor, "spec": spec.describe(), "sqnr_db": stats.sqnr_db}


def _heatmap(fig: Any, ax: Any, values: torch.Tensor, title: str, cmap: str) -> None:
    grid = values.reshape(values.shape[0], -1) if values.ndim > 1 else values.reshape(1, -1)
    step_r = max(1, math.ceil(grid.shape[0] / MAX_SIDE))
    step_c = max(1, math.ceil(grid.shape[1] / MAX_SIDE))
    shown = grid[::step_r, ::step_c].numpy()
    limits: dict[str, float] = {}
    if cmap in ("RdBu_r", "PuOr"):  # diverging maps: keep 0 at the neutral colour
        bound = float(abs(shown).max()) or 1.0
        limits = {"vmin": -bound, "vmax": bound}
    image = ax.imshow(shown, cmap=cmap, aspect="auto", interpolation="nearest", **limits)
    fig.colorbar(image, ax=ax, fraction=0.046)
    sampled = f" (every {step_r}x{step_c})" if step_r > 1 or step_c > 1 else ""
    ax.set_title(title + sampled, fontsize=10)


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
    if spec.axis is not None:
        narrow = int((high - low).argmin())
        ax.axvspan(float(low[narrow]), float(high[narrow]), color="#2ca02c", alpha=0.2,
                   label="narrowest channel's range")  # fmt: skip
    ax.axvline(0.0, color="black", linewidth=0.5)
    ax.set_title("values and the quantization grid's range", fontsize=10)
    ax.legend(fontsize=8)
