"""The allocation's knapsack stays within its stated memory whatever the target and the number
of tensors (docs/reliability.md, "Allocation targets"): its table's unit grows instead."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CAPPED = """
import resource, sys
cap = int(sys.argv[1])
import numpy
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
from qtool.numerics.allocate import Candidate, TensorLadder, within_bytes, within_loss
ladders = [
    TensorLadder(f"t{i}", (Candidate("a", 10**7, 1.0), Candidate("b", 2 * 10**7, 0.5),
                           Candidate("c", 4 * 10**7, 0.0)))
    for i in range(20_000)
]
plan = within_bytes(ladders, 3 * 10**7 * 20_000)
assert plan.nbytes <= 3 * 10**7 * 20_000, plan.nbytes
plan = within_loss(ladders[:5_000], 2_000.0)
assert plan.loss <= 2_000.0
print("ok", plan.granularity)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS")
def test_twenty_thousand_tensors_and_a_terabyte_target_fit_in_a_small_address_space() -> None:
    """20,000 tensors at 65,536 units each would need 1.3 GB of backpointers (a KL target's
    table: 5,000 tensors, 320 MB); the bound
    (MAX_CELLS, 64 MiB) keeps the solver under an address-space cap of 400 MiB (about 140 MiB
    of it the interpreter and numpy)."""
    cap = 400 * 2**20  # the interpreter and numpy map about 140 MiB
    done = subprocess.run(
        [sys.executable, "-c", _CAPPED, str(cap)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok ")
