"""calibrate --sensitivity reports its joint pass: the fit the file stores (gain, saturation,
additivity) and the two joint KLs are in the summary, the console and --json, and the joint
pass moves the progress bar through all its work (it ran with the bar stopped at the end of
the per-Linear pass)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from qtool.engine.calibrate.run import CalibrateOptions, calibrate  # noqa: E402
from qtool.formats.imatrix import read_imatrix_file  # noqa: E402
from qtool.formats.imatrix.sensitivity import read_sensitivities  # noqa: E402
from tests.conftest import run_qtool  # noqa: E402
from tests.eval_models import build  # noqa: E402

CTX = 32
TEXT = " ".join(f"alpha {i} beta {i * 7 % 13} gamma." for i in range(120))


class Counting:
    """Each start's total and what was advanced after it."""

    def __init__(self) -> None:
        self.phases: list[list[Any]] = []

    def start(self, total: int) -> None:
        self.phases.append([total, 0, set()])

    def advance(self, name: str, n: int) -> None:
        self.phases[-1][1] += n
        self.phases[-1][2].add(name.split(",")[0])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("joint")
    text = root / "calib.txt"
    text.write_text(TEXT)
    return build(root / "llama", "llama-tied"), text


def test_the_joint_pass_moves_the_progress_bar(model: tuple[Path, Path], tmp_path: Path) -> None:
    path, text = model
    opts = CalibrateOptions((text,), tokens=6 * CTX, ctx=CTX, sensitivity_tokens=2 * CTX)
    progress = Counting()
    summary = calibrate(path, tmp_path / "x.gguf", opts, progress)
    total, done, names = progress.phases[-1]
    assert summary.tokens == 6 * CTX  # the joint pass takes every window here
    assert names == {"joint"} and done == total == 3 * 6 * CTX  # three streams through the model
    assert all(t == d for t, d, _ in progress.phases)  # every phase ends full


def test_the_joint_fit_is_reported_as_stored(model: tuple[Path, Path], tmp_path: Path) -> None:
    path, text = model
    out = tmp_path / "x.gguf"
    args = ["calibrate", str(path), "-o", str(out), "--text", str(text), "--tokens",
            str(6 * CTX), "--ctx", str(CTX), "--sensitivity", "--sensitivity-tokens",
            str(2 * CTX)]  # fmt: skip
    code, stdout, err = run_qtool(*args, "--json")
    assert code == 0, err
    joint = json.loads(stdout)["sensitivity"]["joint"]
    stored = read_sensitivities(out, read_imatrix_file(out).metadata)
    assert stored is not None and stored.joint is not None and joint["fitted"]
    assert (joint["gain"], joint["saturation"], joint["additivity"]) == pytest.approx(stored.joint)
    assert joint["tokens"] == 6 * CTX and 0 < joint["kl_half"] < joint["kl"]
    code, stdout, err = run_qtool(*args, "--force")
    assert code == 0, err
    said = " ".join(stdout.split())  # the console wraps to its width
    assert "joint KL of every tensor at once" in said
    assert f"predicted KL = {stored.joint[0]:.4g} S / (1 + {stored.joint[1]:.4g} S)" in said
