"""Loading a block for calibration or a calibrated method checks each weight for NaN/Inf
(engine/calibrate/blocks._finite) without copies of the weight: counting the non-finite values
over the whole tensor made a boolean and an int64 copy of it, 9 bytes per float32 value on top
of the weight (SmolLM2's embeddings: 248 MiB more at the run's peak, 593 -> 761 MiB). Measured
as the peak resident set of a fresh process (ru_maxrss), not timed."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import resource, torch
from qtool.engine.calibrate.blocks import _finite
from qtool.errors import NumericError
values = torch.ones(16 << 20)  # 64 MiB of float32, touched
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
_finite(values, "w", "model", True)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
values[3] = float("nan")
values[5] = float("inf")
try:
    _finite(values, "w", "model", True)
except NumericError as err:
    print(err)
"""


def test_the_finite_check_of_a_loaded_weight_copies_nothing() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=300
    ).stdout.splitlines()
    grown_kib = int(out[0])
    assert grown_kib < 8 << 10, f"the check grew the peak by {grown_kib} KiB (a 64 MiB weight)"
    assert "has 2 NaN/Inf values" in out[1]
