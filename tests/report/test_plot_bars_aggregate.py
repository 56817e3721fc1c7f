"""The SQNR chart of a large model (issue 33 polish): `quantize --plot` of SmolLM2 drew 211
bars, unreadable. Past MAX_BARS measured tensors there is one bar per layer type (numbers as
`*`), at its worst tensor's SQNR, red when it holds an outlier; small models keep a bar per
tensor. Bars are counted, not looked at."""

from __future__ import annotations

import pytest

from qtool.results import ErrorStats, QuantizeRow

pytest.importorskip("matplotlib")
from qtool.engine import plots  # noqa: E402

TYPES = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj",
         "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]  # fmt: skip


def _row(name: str, sq_error: float) -> QuantizeRow:
    stats = ErrorStats(4, sq_error, 4.0, 1.0)
    return QuantizeRow(name, (2, 2), "BF16", "I8", True, "", 16, 16, errors=stats)


def _smollm2_like() -> list[QuantizeRow]:
    """30 layers of 7 Linears and the embedding: 211 measured tensors, one far worse."""
    rows = [_row("model.embed_tokens.weight", 4e-3)]
    for i in range(30):
        rows += [_row(f"model.layers.{i}.{t}.weight", 0.5 if (i, t) == (7, "mlp.down_proj")
                      else 4e-3 * (1 + i % 3)) for t in TYPES]  # fmt: skip
    return rows


def _bars(rows: list[QuantizeRow]) -> tuple[list[float], list[str], list[str], str]:
    plt = plots._pyplot()
    fig, axes = plots._figure(plt, 1, 1)
    ax = axes[0, 0]
    try:
        plots._sqnr_bars(ax, rows, "t", None)
        heights = [p.get_height() for p in ax.patches]
        colors = [str(p.get_facecolor()) for p in ax.patches]
        labels = [t.get_text() for t in ax.get_xticklabels()]
        return heights, colors, labels, ax.get_title(loc="left")
    finally:
        plt.close(fig)


def test_many_tensors_give_one_bar_per_layer_type_at_its_worst() -> None:
    rows = _smollm2_like()
    heights, colors, labels, title = _bars(rows)
    assert len(rows) == 211 and len(heights) == 1 + len(TYPES) <= plots.MAX_BARS
    assert "211 tensors, 8 bars" in title
    down = next(i for i, label in enumerate(labels) if "down_proj" in label)
    assert "×30" in labels[down] and "*" in labels[down]
    worst = min(r.errors.sqnr_db for r in rows if r.errors and "down_proj" in r.name)
    assert heights[down] == pytest.approx(worst)  # the group's worst tensor
    assert sum(c != colors[0] for c in colors) == 1 and colors[down] != colors[0]  # red: one


def test_a_small_model_keeps_a_bar_per_tensor() -> None:
    rows = _smollm2_like()[: plots.MAX_BARS]
    heights, _, _, title = _bars(rows)
    assert len(heights) == len(rows) and "bars" not in title
