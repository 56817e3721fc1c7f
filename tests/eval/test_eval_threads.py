"""How many threads eval's and calibrate's forward passes run on (engine/threads.py): by default
the cores not busy (a count above the free cores made eval of SmolLM2 3-4x slower on a busy
2-core machine, issue 33), `--threads N` as given, and an in-process caller's own count back
afterwards. The load average and the affinity mask are faked; the count is read inside the
pass itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

REASON = "needs the interop extra: pip install -c constraints.txt -e '.[interop]'"
pytest.importorskip("transformers", reason=REASON)

import torch  # noqa: E402

from qtool import api  # noqa: E402
from qtool.engine import threads  # noqa: E402
from qtool.engine.calibrate import run as calibrate_run  # noqa: E402
from qtool.engine.evaluate import run as eval_run  # noqa: E402
from qtool.spec import PerChannel, QSpec, Scheme, StorageDtype  # noqa: E402
from tests.eval_models import build  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

INT8 = QSpec(Scheme.SYM, StorageDtype.INT8, PerChannel(0))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("threads")
    build(root / "llama", "llama")
    out = root / "llama.int8"
    api.quantize(root / "llama", out, api.QuantizeOptions(INT8), device="cpu")
    return root / "llama", out


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Fake the CPUs this process may use and the load average; torch starts on 2 threads."""

    def fake(cpus: int, load: float | None) -> None:
        monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cpus)))
        if load is None:

            def no_load() -> tuple[float, float, float]:
                raise OSError("no load average")

            monkeypatch.setattr(threads.os, "getloadavg", no_load)
        else:
            monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, load, load))

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield fake
    torch.set_num_threads(before)


def _eval_threads(models: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, n: int | None) -> int:
    """The thread count torch had while eval's pass ran."""
    seen: list[int] = []
    real = eval_run.causal_pass

    def spy(*args: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args)

    monkeypatch.setattr(eval_run, "causal_pass", spy)
    api.evaluate(*models, api.EvalOptions(tokens=64, ctx=32, threads=n))
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize(
    ("cpus", "load", "expected"),
    [(2, 2.0, 1), (2, 9.5, 1), (2, 0.3, 2), (4, 1.2, 3), (4, 0.0, 4), (8, None, 8)],
)
def test_eval_defaults_to_the_free_cores(
    models: tuple[Path, Path],
    machine: Any,
    monkeypatch: pytest.MonkeyPatch,
    cpus: int,
    load: float | None,
    expected: int,
) -> None:
    """Busy cores are not counted (torch's default counted them: 2 threads at a load of 9.5);
    no load average (another OS) counts every core the process may use."""
    machine(cpus, load)
    assert _eval_threads(models, monkeypatch, None) == expected
    assert torch.get_num_threads() == 2  # the caller's count back


def test_eval_threads_as_given(
    models: tuple[Path, Path], machine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    machine(2, 9.5)
    assert _eval_threads(models, monkeypatch, 3) == 3
    assert torch.get_num_threads() == 2


def test_calibrate_defaults_to_the_free_cores(
    models: tuple[Path, Path], machine: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    machine(2, 4.0)
    seen: list[int] = []
    real = calibrate_run.run_blocks

    def spy(*args: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args)

    monkeypatch.setattr(calibrate_run, "run_blocks", spy)
    api.calibrate(models[0], tmp_path / "m.imatrix.gguf", (), 64, 32, "cpu", False, None)
    assert seen == [1]
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize(
    ("available", "load", "expected"),
    [(1, 0.0, 1), (1, 5.0, 1), (2, 1.4, 1), (2, 0.6, 1), (2, 0.4, 2), (16, 3.0, 13)],
)
def test_free_cores(available: int, load: float, expected: int) -> None:
    """At least one thread, never more than the cores, busy ones rounded to the nearest."""
    assert threads.free_cores(available, load) == expected


def test_several_candidates_run_every_pass_on_the_free_cores(
    models: tuple[Path, Path], machine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qtool eval FLOAT Q1 Q2`: the float pass and each candidate's pass on the idle cores (as
    a pair run), `--threads` as given, and the caller's count back after."""
    from qtool.engine.evaluate import many

    seen: list[int] = []
    for name in ("float_pass", "scored_pass"):
        real = getattr(many, name)

        def spy(*args: Any, real: Any = real) -> Any:
            seen.append(torch.get_num_threads())
            return real(*args)

        monkeypatch.setattr(many, name, spy)
    machine(4, 1.2)
    options = api.EvalOptions(tokens=64, ctx=32)
    # two distinct candidates: the same QUANT twice is refused
    api.evaluate_all(models[0], [models[1], models[0]], options)
    assert seen == [3, 3, 3] and torch.get_num_threads() == 2
    seen.clear()
    api.evaluate_all(
        models[0], [models[1], models[0]], api.EvalOptions(tokens=64, ctx=32, threads=1)
    )
    assert seen == [1, 1, 1] and torch.get_num_threads() == 2
