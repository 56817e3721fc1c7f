"""One thread count for torch and numba (numerics/numba_pool.py): a fused kernel, the first in
the process, leaves torch's count as it was. numba's pool once started inside the first kernel
set the OpenMP runtime it shares with torch to numba's pool size, so eval at `--threads 1` ran
every torch operation after a GGUF's dequantization on all cores (issue 33 item 12).

Each case runs in a fresh interpreter (the pool starts once per process), with numba's pool
larger than torch's count so that the leak is visible on any machine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("numba")

SCRIPT = """
import torch
torch.set_num_threads(1)
from qtool.numerics import gguf, kernels
from qtool.numerics.select import Kernel
from qtool.spec import QSpec
{call}
print(torch.get_num_threads())
"""

KERNELS = {
    "gguf dequantize": "gguf.dequantize(torch.zeros(64, 20, dtype=torch.uint8), 'Q4_1', "
    "kernel=Kernel.FUSED)",
    "gguf quantize": "gguf.quantize(torch.randn(4, 64), 'Q8_0', kernel=Kernel.FUSED)",
    "fused quantize": "kernels.quantize_with(torch.randn(300, 300), QSpec())",
    "compare's sums": "from qtool.numerics import fused_compare\n"
    "fused_compare.error_stats(torch.randn(300, 300), torch.randn(300, 300))",
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_a_first_fused_kernel_keeps_torchs_thread_count(kernel: str) -> None:
    env = os.environ | {"QTOOL_KERNEL": "fused", "NUMBA_NUM_THREADS": "3"}
    script = textwrap.dedent(SCRIPT).format(call=KERNELS[kernel])
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "1"
