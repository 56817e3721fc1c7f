"""The automatic kernel choice (numerics/select.py): by the work (elements, dtype, spec), then
by the torch kernels' measured speed; and the note when numba would have saved much time."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch

from qtool.numerics import kernels, select
from qtool.spec import PerChannel, PerGroup, PerTensor, QSpec, RangeMethod, Scheme, StorageDtype

needs_numba = pytest.mark.skipif(not select.numba_installed(), reason="numba not installed")
CPU = torch.device("cpu")
MSE = QSpec(range_method=RangeMethod.MSE)
LAYER = [(384, 384)] * 4 + [(1536, 384), (384, 1536)]
MINILM = [select.Work(s, False, MSE) for s in [(30522, 384), (512, 384), *LAYER * 6]]


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[select._Loader]:
    loader = select._Loader()
    monkeypatch.setattr(select, "_LOADER", loader)
    monkeypatch.setattr(select, "_METER", select._Meter())
    monkeypatch.delenv(select.ENV, raising=False)
    yield loader


@pytest.fixture
def no_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "numba", None)  # type: ignore[arg-type]
    monkeypatch.delitem(sys.modules, "qtool.numerics.fused", raising=False)


class Clock:
    """select's perf_counter: each torch call takes `step` seconds."""

    def __init__(self, step: float) -> None:
        self.now, self.step, self.calls = 0.0, step, 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:
            self.now += self.step
        return self.now


@pytest.mark.parametrize(
    ("spec", "shape", "kind"),
    [
        (QSpec(), (64, 64), "minmax"),
        (QSpec(granularity=PerTensor()), (64, 64), "minmax"),
        (QSpec(granularity=PerGroup(32)), (64, 64), "groups"),
        (QSpec(granularity=PerGroup(64)), (64, 64), "minmax"),  # a group per row
        (MSE, (64, 64), "mse"),
        (QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(32), RangeMethod.MSE), (8, 64), "mse"),
        (QSpec(granularity=PerTensor(), range_method=RangeMethod.MSE), (64, 64), None),
        (QSpec(granularity=PerChannel(1), range_method=RangeMethod.MSE), (64, 64), None),
        (QSpec(), (), None),
    ],
    ids=[
        "channel",
        "tensor",
        "groups",
        "group=row",
        "mse",
        "int4-mse",
        "mse-tensor",
        "mse-axis1",
        "0-d",
    ],  # fmt: skip
)
def test_work_classes(spec: QSpec, shape: tuple[int, ...], kind: str | None) -> None:
    assert select.work_class(spec, shape) == kind


@needs_numba
def test_an_mse_search_of_minilm_loads_the_fused_kernels_up_front(fresh: select._Loader) -> None:
    """26 s with the torch kernels on a busy machine, seconds with the fused ones (issue 22)."""
    select.expect_work(CPU, MINILM)
    assert fresh.module is not None


@needs_numba
def test_the_same_bytes_of_min_max_do_not(fresh: select._Loader) -> None:
    select.expect_work(CPU, [select.Work(w.shape, w.wide, QSpec()) for w in MINILM])
    assert not fresh.tried


@needs_numba
def test_slow_torch_calls_bring_in_the_fused_kernels_mid_run(
    fresh: select._Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under load the torch kernels run many times slower than on a quiet machine: measured,
    that makes the rest of the run worth loading numba for."""
    work = [select.Work((1024, 1024), False, QSpec())] * 200  # 1 s of quiet torch time
    select.expect_work(CPU, work)
    assert not fresh.tried
    x = torch.randn(1024, 1024)
    monkeypatch.setattr(select.time, "perf_counter", Clock(0.05))  # 10x a quiet machine
    calls = 0
    while fresh.module is None and calls < 20:
        kernels.quantize_with(x, QSpec())
        calls += 1
    assert fresh.module is not None and 3 <= calls < 20  # once 10 ms of work were timed


@needs_numba
def test_quiet_torch_calls_keep_the_torch_kernels(
    fresh: select._Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    select.expect_work(CPU, [select.Work((1024, 1024), False, QSpec())] * 200)
    monkeypatch.setattr(select.time, "perf_counter", Clock(1024 * 1024 * 4e-9))
    x = torch.randn(1024, 1024)
    for _ in range(50):
        kernels.quantize_with(x, QSpec())
    assert not fresh.tried


@needs_numba
def test_a_tiny_call_slowed_by_a_busy_machine_proves_nothing(
    fresh: select._Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call of a few thousand elements is all fixed costs: however long a busy machine makes
    it, it says nothing of the kernels' speed on the run's real work."""
    select.expect(CPU, select.AUTO_MIN_BYTES - 1)
    monkeypatch.setattr(select.time, "perf_counter", Clock(0.5))
    for _ in range(3):
        kernels.quantize_with(torch.randn(64, 48), QSpec())
    assert not fresh.tried


@pytest.mark.usefixtures("no_numba")
def test_without_numba_a_slow_run_says_what_it_missed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    select.expect_work(CPU, [select.Work((256, 256), False, MSE)] * 10)
    monkeypatch.setattr(select.time, "perf_counter", Clock(2.0))  # 2 s per tensor
    for _ in range(10):  # 3.3 ms of quiet work each
        kernels.quantize_with(torch.randn(256, 256), MSE)
    notes = select.notes()
    assert len(notes) == 1 and "pip install 'qtool[fast]'" in notes[0]
    assert "took 20 s" in notes[0]
    assert select.notes() == []  # once


@pytest.mark.usefixtures("no_numba")
def test_without_numba_a_quick_run_says_nothing() -> None:
    select.expect_work(CPU, [select.Work((64, 64), False, MSE)])
    kernels.quantize_with(torch.randn(64, 64), MSE)
    assert select.notes() == []


@pytest.mark.usefixtures("no_numba")
def test_a_chosen_kernel_gets_no_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(select.ENV, "torch")
    select.expect_work(CPU, [select.Work((256, 256), False, MSE)] * 10)
    monkeypatch.setattr(select.time, "perf_counter", Clock(2.0))
    for _ in range(10):
        kernels.quantize_with(torch.randn(256, 256), MSE)
    assert select.notes() == []
