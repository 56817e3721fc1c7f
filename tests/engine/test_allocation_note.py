"""The allocation note under quantize's table states its predicted figures as the other
figures of the run are stated (model KL, eval's KL: 4 significant digits): the relative-error
loss (no sensitivities) printed 9 digits ('0.000189122') beside a KL cut to 4."""

from __future__ import annotations

import re

import pytest

from qtool.engine.allocate import summary_line
from qtool.numerics.allocate import Target
from qtool.results import AllocationPlan

LOSS = 0.000189122137


def _plan(measured: bool, joint_fit: bool = False) -> AllocationPlan:
    return AllocationPlan(
        "bpw", 4.5, 1_000_000, 4.51, LOSS, measured, 1, (("int4 g64", 3, 1_000_000),),
        sum_alpha_r=0.00123456789, joint_fit=joint_fit,
    )  # fmt: skip


def _significant(figure: str) -> int:
    mantissa = figure.split("e")[0].replace(".", "").lstrip("0")
    return len(mantissa)


@pytest.mark.parametrize(("measured", "joint_fit"), [(False, False), (True, False), (True, True)])
def test_predicted_figures_have_four_significant_digits(measured: bool, joint_fit: bool) -> None:
    note = summary_line(Target("bpw", 4.5), _plan(measured, joint_fit))
    loss = re.search(r"predicted (?:KL|loss \(relative output error, alpha = 1\)) ([0-9.e+-]+)",
                     note)  # fmt: skip
    assert loss is not None, note
    assert loss.group(1) == "0.0001891"
    assert _significant(loss.group(1)) == 4
    for s in re.findall(r"S = sum alpha r ([0-9.e+-]+)", note):
        assert _significant(s) <= 4, note
