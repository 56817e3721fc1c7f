"""What a calibrated run (`quantize --method`) holds while its block pass runs: only what the
pass needs. Objects used before it (the tokenizer, which turns the texts into windows) are
let go first, reference cycles included, since the CLI pauses the cyclic collector; held,
they add to the peak of every block (SmolLM2's tokenizer: 49 MiB of the resident set)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from qtool.calibration import Method  # noqa: E402
from qtool.engine.calibrate import sequential  # noqa: E402
from qtool.engine.methods import gptq as method_gptq  # noqa: E402
from qtool.engine.methods import run as method_run  # noqa: E402
from qtool.engine.methods import verdict  # noqa: E402
from qtool.numerics import gptq  # noqa: E402
from tests.engine.test_gptq_pass import _options, _quantize, calibration_model  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return calibration_model(tmp_path_factory.mktemp("memory"))


@pytest.fixture()
def no_collector() -> Iterator[None]:
    """As the CLI runs a command (cli/app.py main): the cyclic collector paused."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("method", [Method.GPTQ, Method.AWQ])
def test_the_tokenizer_is_let_go_before_the_block_pass(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_collector: None,
    method: Method,
) -> None:  # fmt: skip
    loaded: list[weakref.ref[Any]] = []
    alive: list[bool] = []
    float_parts, run_sequential = (
        getattr(method_run, n) for n in ("float_parts", "run_sequential")
    )

    def parts(*args: Any) -> Any:
        checkpoint, hf_config, tokenizer = float_parts(*args)
        loaded.append(weakref.ref(tokenizer.backend))
        return checkpoint, hf_config, tokenizer

    def sequential(*args: Any, **kwargs: Any) -> None:
        alive.append(loaded[0]() is not None)
        run_sequential(*args, **kwargs)

    monkeypatch.setattr(method_run, "float_parts", parts)
    monkeypatch.setattr(method_run, "run_sequential", sequential)
    _quantize(model, tmp_path / "out", _options(model, method=method))
    assert alive == [False]


def test_each_solve_and_the_pass_give_their_memory_back_before_the_next_step(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Freed tensors under glibc's mmap threshold stay resident until trimmed: each Linear's
    GPTQ temporaries are given back before the next Linear's solve (not once per block: on
    SmolLM2 the block phase's peak was 75 MiB higher; the last Linear's trim is the block's
    before pass 2, with no second one there: 641d5e1), and the pass's last block and fit
    windows before the model KL reads the head."""
    events: list[str] = []
    solve, head = gptq.gptq_quantize, verdict._head
    run_sequential = getattr(method_run, "run_sequential")  # noqa: B009 (not exported: mypy)

    def solving(*args: Any, **kwargs: Any) -> Any:
        events.append("solve")
        return solve(*args, **kwargs)

    def reading(*args: Any) -> Any:
        events.append("head")
        return head(*args)

    def trim() -> None:
        events.append("trim")

    def passing(*args: Any, **kwargs: Any) -> None:
        run_sequential(*args, **kwargs)
        events.append("pass done")  # its windows are freed only now

    monkeypatch.setattr(gptq, "gptq_quantize", solving)
    monkeypatch.setattr(verdict, "_head", reading)
    monkeypatch.setattr(method_run, "run_sequential", passing)
    for module in (method_gptq, verdict, sequential):
        monkeypatch.setattr(module, "return_freed_memory", trim)
    _quantize(model, tmp_path / "out", _options(model))
    solves = [i for i, e in enumerate(events) if e == "solve"]
    assert len(solves) > 1
    for a, b in zip(solves, solves[1:], strict=False):
        assert "trim" in events[a:b]
    assert events[solves[-1] :].count("trim") >= 1
    assert events[events.index("pass done") : events.index("head")] == ["pass done", "trim"]
