"""--target-bpw is bounded like --target-size (2^62 bytes): above 64 bits per weight (float64
kept, the most any plan stores) it is a usage error (exit 2, one line) before any work; 1e308
was an internal OverflowError, 1e30 a run that kept every tensor float."""

from __future__ import annotations

from pathlib import Path

import pytest

from qtool.numerics.allocate import Target
from tests.conftest import Invoke

GGUF = Path(__file__).resolve().parents[2] / "sample_weights" / "tiny-llama.gguf"


@pytest.mark.parametrize("value", ["1e308", "1e30", "64.5"])
def test_a_bpw_target_above_64_is_a_usage_error(invoke: Invoke, value: str) -> None:
    code, out, err = invoke("quantize", str(GGUF), "--format", "gguf", "--target-bpw", value,
                            "--dry-run", "--estimate", "--threads", "1")  # fmt: skip
    assert (code, out) == (2, "")
    assert "--target-bpw" in err and "at most 64" in err
    assert "Traceback" not in err and "internal" not in err
    with pytest.raises(ValueError):
        Target("bpw", float(value))


def test_a_bpw_target_of_64_is_accepted(invoke: Invoke) -> None:
    code, _, err = invoke("quantize", str(GGUF), "--format", "gguf", "--target-bpw", "64",
                          "--dry-run", "--estimate", "--threads", "1")  # fmt: skip
    assert code == 0, err
    assert Target("bpw", 64).bytes_for(8) == 64
