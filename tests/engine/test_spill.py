"""engine/spill.py: the error budget's chosen codes between its two passes."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from qtool.engine import spill as spill_module
from qtool.engine.spill import Spill
from qtool.errors import OutputError
from qtool.numerics.kernels import quantize_tensor
from qtool.spec import PerChannel, PerGroup, PerTensor, QSpec, RangeMethod, StorageDtype

SPECS = [
    QSpec(granularity=PerChannel(0)),
    QSpec(dtype=StorageDtype.INT4, granularity=PerGroup(16), range_method=RangeMethod.MSE),
]


@pytest.mark.parametrize("spec", SPECS, ids=["int8-channel", "int4-g16-mse"])
def test_what_was_put_is_taken_back_bit_exact_once(tmp_path: Path, spec: QSpec) -> None:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    result = quantize_tensor(x, spec)
    spill = Spill(tmp_path)
    try:
        spill.put("w", spec, result)
        assert os.listdir(tmp_path) == []  # anonymous: nothing to leave behind
        assert spill.take("w", QSpec(granularity=PerTensor())) is None  # another spec: again
        spill.put("w", spec, result)
        back = spill.take("w", spec)
        assert back is not None and spill.take("w", spec) is None
        for part in ("q", "scale", "zero_point", "choice"):
            a, b = getattr(result, part), getattr(back, part)
            assert (a is None and b is None) or torch.equal(a, b), part
        assert back.errors == result.errors
    finally:
        spill.close()


def test_a_dry_run_keeps_the_figures_alone() -> None:
    result = quantize_tensor(torch.randn(8, 8), SPECS[0])
    spill = Spill(None)
    spill.put("w", SPECS[0], result)
    figures = spill.figures("w", SPECS[0])
    assert figures is not None and figures.errors == result.errors
    assert spill.take("w", SPECS[0]) is None


def test_a_full_disk_is_one_output_error_and_close_still_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*_: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spill_module.os, "pwrite", full)
    spill = Spill(tmp_path)
    result = quantize_tensor(torch.randn(8, 8), SPECS[0])
    with pytest.raises(OutputError, match="the calibrated method.s codes or the budget.s"):
        spill.put("w", SPECS[0], result)
    spill.close()
    spill.close()  # twice: the run's finally may come after an error
