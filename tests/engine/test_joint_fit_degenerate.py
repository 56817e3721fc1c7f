"""calibrate --sensitivity's joint fit when its two points fit no curve: the KL at half the
reference not below the KL at the reference (noise on near-zero KLs, a model the perturbation
barely reaches). The fit is left out (no qtool.sensitivity.joint key: predicted KL = S), never
a ZeroDivisionError after the whole run, nor a non-positive gain that the reader refuses,
making the whole imatrix unusable."""

from __future__ import annotations

import math

import pytest

from qtool.engine.calibrate.sensitivity import Joint, Measured, Sensitivity
from qtool.formats.imatrix.sensitivity import JOINT_KEY, parse
from qtool.numerics.sensitivity import joint_fit

FOUND = {"a.weight": Sensitivity(0.01, 0.2, 20.0), "b.weight": Sensitivity(0.02, 0.1, 5.0)}
NAMES = {"a.weight": "blk.0.attn_q.weight", "b.weight": "blk.0.attn_k.weight"}


@pytest.mark.parametrize(
    ("kl", "kl_half"),
    [(0.3, 0.3), (0.3, 0.31), (0.3, 1e308), (1e-320, 1e-321), (0.3, math.nan)],
    ids=["equal", "half-above", "half-huge", "subnormal", "nan"],
)
def test_a_degenerate_joint_measurement_writes_no_fit(kl: float, kl_half: float) -> None:
    measured = Measured(dict(FOUND), windows=1, tokens=8, joint=Joint(kl, kl_half, 8, 0.25))
    keys = measured.keys(NAMES)
    assert JOINT_KEY not in keys
    read = parse(keys)  # the file stays usable: alpha read back, S is the prediction
    assert read is not None and read.joint is None and read.predicted(0.5) == 0.5


def test_a_sound_joint_measurement_writes_its_fit() -> None:
    measured = Measured(dict(FOUND), windows=1, tokens=8, joint=Joint(0.25, 0.07, 8, 0.28))
    read = parse(measured.keys(NAMES))
    assert read is not None and read.joint is not None
    assert read.predicted(0.3) == pytest.approx(0.25) and read.predicted(0.075) == pytest.approx(
        0.07
    )


@pytest.mark.parametrize(
    "points",
    [(1.0, 0.5, 0.25, 0.5), (1.0, 0.5, 0.25, 0.6), (1.0, 0.0, 0.25, 0.1), (1.0, 0.5, 1.0, 0.4)],
    ids=["flat", "falling", "zero-kl", "same-s"],
)
def test_joint_fit_is_none_without_a_positive_slope(points: tuple[float, ...]) -> None:
    assert joint_fit(*points) is None
