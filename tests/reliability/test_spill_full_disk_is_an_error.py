"""The activations a calibrated method spills to a mapped temporary file have their disk space
reserved (posix_fallocate) before the first page is touched: on a full disk the run fails with
one line naming the output's directory and what to do, exit 1, nothing left behind, instead of
a SIGBUS at the first page the disk has no room for (the process killed, no message)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.conftest import Invoke
from tests.outputs import ERROR_LINE

pytest.importorskip("transformers")

from qtool.engine.calibrate import sequential  # noqa: E402
from qtool.engine.methods import run as method_run  # noqa: E402

TEXT = " ".join(f"alpha {i} beta {i * 7 % 13} gamma." for i in range(80))
TINY_LM = Path(__file__).parents[2] / "sample_weights" / "tiny-lm"


def test_a_full_disk_under_the_spill_is_one_line(
    tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "calib.txt").write_text(TEXT)
    out = tmp_path / "out"
    out.mkdir()
    asked: list[int] = []

    def full(fd: int, offset: int, length: int) -> None:
        asked.append(length)
        assert offset == 0 and os.fstat(fd).st_size == length  # the whole mapped file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sequential, "ACTIVATIONS_IN_MEMORY", 0)  # every boundary spilled
    monkeypatch.setattr(method_run, "ACTIVATIONS_IN_MEMORY", 0)
    monkeypatch.setattr(os, "posix_fallocate", full)
    rc, stdout, err = invoke(
        "quantize", str(TINY_LM), "--method", "gptq", "--text", str(tmp_path / "calib.txt"),
        "--tokens", "256", "--ctx", "32", "--dtype", "int4", "--group-size", "16",
        "--threads", "1", "-o", str(out / "q"),
    )  # fmt: skip
    assert (rc, stdout) == (1, ""), err
    assert ERROR_LINE.match(err), err
    assert "cannot keep the activations" in err and "no space left on device" in err, err
    assert len(asked) == 1 and asked[0] > 0
    assert os.listdir(out) == []
