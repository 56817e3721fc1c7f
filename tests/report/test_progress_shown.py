"""Progress on the commands a user waits for (issue 33): compare and dequantize report every
tensor's bytes to the same bar quantize uses, on a terminal only (never on a pipe or under
--json); eval's and calibrate's bars show the time left as quantize's does."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from safetensors.torch import save_file

from qtool import api
from qtool.cli import render
from qtool.report import calibrate_console, console, eval_console


class Recorder:
    """A Progress that keeps what it was told."""

    def __init__(self) -> None:
        self.total: int | None = None
        self.done = 0
        self.names: set[str] = set()

    def start(self, total_bytes: int) -> None:
        self.total = total_bytes

    def advance(self, name: str, nbytes: int) -> None:
        assert self.total is not None, "advanced before start"
        self.names.add(name)
        self.done += nbytes


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    gen = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i}.weight": torch.randn(16, 32, generator=gen) for i in range(5)}
    tensors["layer.0.bias"] = torch.randn(16, generator=gen)
    save_file(tensors, tmp_path / "m.safetensors")
    api.quantize(tmp_path / "m.safetensors", tmp_path / "q.safetensors", api.QuantizeOptions())
    return tmp_path / "m.safetensors", tmp_path / "q.safetensors"


def test_compare_reports_every_tensor(pair: tuple[Path, Path]) -> None:
    progress = Recorder()
    summary = api.compare(*pair, progress=progress)
    assert progress.names == {r.name for r in summary.rows}
    assert progress.done == progress.total == sum(r.bytes_a + r.bytes_b for r in summary.rows)


def test_dequantize_reports_every_tensor(pair: tuple[Path, Path], tmp_path: Path) -> None:
    progress = Recorder()
    summary = api.dequantize(pair[1], tmp_path / "r.safetensors", progress=progress)
    assert progress.names == {r.name for r in summary.rows}
    assert progress.total is not None and progress.total > 0
    assert progress.done == progress.total


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """stderr as an interactive terminal, for the modules that draw a bar."""

    def fake(file: Any = None) -> Console:
        return Console(file=io.StringIO(), force_terminal=True, force_interactive=True)

    for module in (console, eval_console, calibrate_console):
        monkeypatch.setattr(module, "console", fake)


def test_a_bar_on_a_terminal_none_under_json(terminal: None) -> None:
    with render.shown_progress(False) as bar:
        assert bar is not None
    with render.shown_progress(True) as bar:
        assert bar is None


def test_no_bar_on_a_pipe() -> None:
    """pytest's captured stderr is no terminal."""
    with render.shown_progress(False) as bar:
        assert bar is None


@pytest.mark.parametrize(
    "bar",
    [eval_console.eval_progress, calibrate_console.calibrate_progress],
    ids=["eval", "calibrate"],
)
def test_token_bars_show_the_time_left(terminal: None, bar: Any) -> None:
    with bar() as progress:
        assert progress is not None
        columns = progress._progress.columns
    assert any(isinstance(c, console._SteadyTimeLeft) for c in columns)


def test_dequantize_to_a_float_gguf_with_progress(tmp_path: Path) -> None:
    """The float GGUF writer needs the GGUF reader itself: progress must not hide its class."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from qtool.formats.gguf import plan
    from qtool.formats.gguf.writer import write_quantized
    from qtool.io.atomic import OutputSet
    from qtool.io.gguf_file import GGUFFile
    from qtool.spec import gguf_spec
    from tests import gguf_models

    d = gguf_models.make_hf_llama(tmp_path / "tiny")
    src = gguf_models.write_float_gguf(d, d / "f32.gguf", "F32")
    with GGUFFile(src) as f, OutputSet() as outputs:
        asked = {t.name: gguf_spec("Q8_0") for t in f.header.tensors}
        write_quantized(f, plan.choose(f.header.tensors, asked, "llama"), d / "q8.gguf", outputs)
        outputs.commit()
    progress = Recorder()
    summary = api.dequantize(d / "q8.gguf", tmp_path / "back.gguf", progress=progress)
    assert progress.names == {r.name for r in summary.rows}
    assert progress.done == progress.total
