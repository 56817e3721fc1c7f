"""Tables and summaries laid out once for a width (report/layout.py, report/console.py): within
COLUMNS when piped, columns hidden in order and named in a note, summaries wrapped between
phrases, a progress bar that names the current tensor without cutting it needlessly."""

from __future__ import annotations

import io
import os
import sys
from types import FrameType

import pytest

from qtool.report import console, layout
from qtool.report.layout import Column
from qtool.results import ErrorStats, QuantizeRow

NAME = "model.layers.11.self_attn.q_proj.weight"


def _rows(n: int) -> list[QuantizeRow]:
    stats = ErrorStats(884736, 1.06, 884.7, 0.0118)
    return [
        QuantizeRow(f"model.layers.{i}.mlp.up_proj.weight", (1536, 576), "BF16", "I32", True,
                    "sym int4 group 64 (1536x9 groups)", 1769472, 442368, stats)
        for i in range(n)
    ]  # fmt: skip


def _plain(lines: list[layout.Line]) -> list[str]:
    return ["".join(t for t, _ in line).rstrip() for line in lines]


def test_a_table_that_fits_keeps_every_column() -> None:
    columns = console.quantize_columns(_rows(3))
    table = layout.table(columns, 200)
    assert table.hidden == []
    assert "shape" in _plain(table.lines)[1] and "max err" in _plain(table.lines)[1]


@pytest.mark.parametrize("width", [120, 100, 80, 60])
def test_a_narrow_table_hides_columns_in_order_then_folds_and_never_overflows(width: int) -> None:
    table = layout.table(console.quantize_columns(_rows(3)), width)
    order = ["shape", "max err", "MSE", "SQNR bar"]
    assert table.hidden == order[: len(table.hidden)]
    assert all(layout.cell_width(line) <= width for line in _plain(table.lines))
    body = "\n".join(_plain(table.lines))
    assert "SQNR dB" in body and "int4" in body  # what is never hidden


def test_folded_cells_break_at_spaces_and_names_anywhere() -> None:
    names = layout.table([Column("tensor", [(NAME, "")], fold=12)], 13)
    lines = _plain(names.lines)[3:-1]
    assert all(len(line) <= 13 for line in lines) and "".join(s.strip() for s in lines) == NAME
    words = layout.table([Column("what", [("sym int4 group 32 mse", "")], fold=10)], 11)
    assert [s.strip() for s in _plain(words.lines)[3:-1]] == ["sym int4", "group 32", "mse"]


@pytest.mark.parametrize("width", [100, 60, 40])
def test_summaries_wrap_between_phrases(width: int) -> None:
    parts = ["4 of 11 tensors quantized (sym int4 group 32 mse), 7 kept",
             "132.4 KiB → 24.4 KiB (5.44x)", "overall SQNR 24.5 dB",
             "mse range search: -23.6 % squared error vs minmax"]  # fmt: skip
    lines = layout.phrases(parts, width)
    assert all(layout.cell_width(line) <= width for line in lines)
    if width >= 60:  # every phrase whole on one line
        assert all(any(p in line for line in lines) for p in parts)
    words = [w for line in lines for w in line.split() if w != "·"]
    assert words == [w for p in parts for w in p.split()]  # nothing lost, nothing cut


def test_a_comma_stays_at_the_end_of_its_line_and_a_word_is_never_broken() -> None:
    long = "/tmp/" + "x" * 60 + ".safetensors"
    assert layout.phrases(["wrote a.safetensors", long], 40, ", ") == [
        "wrote a.safetensors,",
        "  " + long,
    ]


def test_wide_characters_take_two_cells() -> None:
    assert layout.cell_width("層.weight") == 9 and layout.cell_width("e\u0301") == 1


def test_piped_quantize_output_fits_columns_and_notes_what_it_hid(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from qtool.results import QuantizeSummary
    from qtool.spec import QSpec

    monkeypatch.setenv("COLUMNS", "100")
    rows = _rows(5)
    summary = QuantizeSummary(inputs=["m"], outputs=["q.safetensors"], rows=rows, spec=QSpec(),
                              device="cpu", dry_run=False)  # fmt: skip
    console.print_quantize(summary)
    out = capsys.readouterr().out.splitlines()
    assert max(layout.cell_width(line) for line in out) <= 100
    assert any(line.startswith("(shape") and "hidden to fit 100 columns" in line for line in out)


def _render_calls(rows: int) -> tuple[int, int]:
    """Python calls made to lay out and emit a report of `rows` rows: (all, Rich's)."""
    columns = console.quantize_columns(_rows(rows))
    calls = [0, 0]

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            calls[0] += 1
            calls[1] += f"{os.sep}rich{os.sep}" in frame.f_code.co_filename

    sys.setprofile(profile)
    try:
        lines, _, _ = console._report("Quantization report", columns, ["x"], io.StringIO())
        console.emit(io.StringIO(), lines)
    finally:
        sys.setprofile(None)
    return calls[0], calls[1]


def test_272_rows_are_laid_out_once_not_by_rich_per_row() -> None:
    """Rich took 0.7-0.9 s for SmolLM2's 272 rows (issue 22): it laid out every cell. Counted,
    not timed: Rich's calls do not grow with the rows and all calls grow linearly (27 rows to
    272: 9.4x here, ~96 calls a row)."""
    _render_calls(2)  # imports and caches
    small, large = _render_calls(27), _render_calls(272)
    assert large[1] == small[1], f"Rich called {small[1]} times for 27 rows, {large[1]} for 272"
    assert large[0] < 12 * small[0], f"{small[0]} calls for 27 rows, {large[0]} for 272"


def test_progress_names_are_cut_in_the_middle_only_when_too_long() -> None:
    assert console._middle_cut(NAME, 60) == NAME
    cut = console._middle_cut(NAME, 24)
    assert len(cut) <= 24 and cut.startswith("…11.") and "q_proj" in cut


def test_time_left_is_the_average_speed_since_the_start() -> None:
    from rich.progress import Progress

    with Progress(disable=True) as progress:
        task_id = progress.add_task("", total=1000)
        task = progress.tasks[0]
        task.start_time = task.stop_time = None
        progress.update(task_id, completed=250)
        task.start_time = progress.get_time() - 10.0  # 250 of 1000 bytes in 10 s
        assert str(console._SteadyTimeLeft().render(task)) == "0:00:30"
