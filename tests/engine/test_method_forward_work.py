"""How much of each block a `--method gptq` run computes (engine/calibrate/sequential.py,
engine/methods/gptq.HessianProbe, engine/methods/verdict.py): pass 1 drops the block's outputs,
so once a block's first window showed the order of its Linears every later window stops at the
last one's hook (the down projection's product and the residual never run); the last block's
pass 2 runs only the streams the model KL reads (held out, check text), no later block reading
the others; the model KL's rounding stream takes the guard's round-to-nearest weights instead
of reading and rounding the block again. The output is byte for byte that of the whole work,
counted in down-projection products and block reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from qtool.engine.calibrate import sequential  # noqa: E402
from qtool.engine.methods import gptq as method  # noqa: E402
from qtool.engine.methods.verdict import ModelStreams  # noqa: E402
from tests.engine.test_gptq_pass import _options, _quantize, calibration_model  # noqa: E402

INTERMEDIATE = 128  # the tiny Llama's (tests/eval_models.py): only down_proj takes it in


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return calibration_model(tmp_path_factory.mktemp("work"))


def _run(
    model: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, int, dict[str, bytes]]:
    """(down projections run, blocks read, the output's files)."""
    products = 0
    reads: list[str] = []
    load = sequential.load_module

    def counted(module: Any, prefix: str, *args: Any, **kw: Any) -> None:
        reads.append(prefix)
        load(module, prefix, *args, **kw)

    monkeypatch.setattr(sequential, "load_module", counted)

    def count(module: torch.nn.Module, args: Any, output: Any) -> None:
        nonlocal products
        if isinstance(module, torch.nn.Linear) and module.in_features == INTERMEDIATE:
            products += 1

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        _quantize(model, out, _options(model))
    finally:
        handle.remove()
    files = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}
    return products, sum(p.startswith("model.layers.") for p in reads), files


def test_pass_1_stops_at_the_last_linear_and_the_last_pass_2_at_what_is_read(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2 blocks; 7 windows to fit, 1 held out, 1 of the check text; the model KL carries the
    # float and rounding copies of the held-out and check windows (2 + 2 per block)
    products, reads, files = _run(model, tmp_path / "stopped", monkeypatch)
    first, whole_pass_2, read_pass_2, copies = 1, 9, 2, 4
    assert products == (first + whole_pass_2 + copies) + (first + read_pass_2 + copies)
    assert reads == 2

    monkeypatch.setattr(method.HessianProbe, "_whole", lambda *_: None)  # never learns the order
    monkeypatch.setattr(ModelStreams, "carried", ("fit", "held", "check"))
    after = ModelStreams.after

    def reread(self: ModelStreams, *args: Any) -> None:
        self.given = None
        after(self, *args)

    monkeypatch.setattr(ModelStreams, "after", reread)
    whole, whole_reads, whole_files = _run(model, tmp_path / "whole", monkeypatch)
    assert whole == 2 * (9 + 9 + copies) and whole_reads == 4
    assert files.keys() == whole_files.keys() and len(files) > 1
    assert {n for n in files if files[n] != whole_files[n]} == set()


def test_a_window_calling_its_linears_otherwise_runs_to_the_end() -> None:
    """The stop is for windows that repeat the first whole window's calls: one that calls a
    Linear the first did not (or in another order) is not cut short, and a first window
    that skipped a Linear sets no order at all."""
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    skip_b = [False]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = a, b

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            return y if skip_b[0] else self.b(y) + y

    block = Block()
    probe = method.HessianProbe({"a": a, "b": b}, block)
    ends: list[int] = []
    block.register_forward_hook(lambda *_: ends.append(1))
    x = torch.randn(1, 3, 4)
    with probe:
        skip_b[0] = True
        block(x)  # a alone: no order learned
        skip_b[0] = False
        block(x)  # a, b: the order
        with pytest.raises(method.Enough):
            block(x)
        skip_b[0] = True
        block(x)  # a alone again: runs to its end
    assert len(ends) == 3
    assert probe.hessians[("a", "fit")].rows == 12 and probe.hessians[("b", "fit")].rows == 6
