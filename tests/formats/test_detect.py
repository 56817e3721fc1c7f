"""An already quantized file, or a sidecar, is never quantized again."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from qtool.formats.detect import HeaderView, quantized_format
from tests.conftest import Invoke


@pytest.mark.parametrize("which", ["quantized", "sidecar"])
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"], ["--dry-run", "--estimate"]],
                         ids=["run", "dry-run", "estimate"])  # fmt: skip
def test_quantizing_a_quantized_file_or_a_sidecar_is_refused(
    invoke: Invoke, samples: Path, which: str, dry_run: list[str]
) -> None:
    q = samples / "q.safetensors"
    assert invoke("quantize", str(samples / "mlp.safetensors"), "-o", str(q))[0] == 0
    target = q if which == "quantized" else samples / "q.qparams.safetensors"
    before = sorted(p.name for p in samples.iterdir())
    code, stdout, stderr = invoke("quantize", str(target), "-o", str(samples / "x.safetensors"),
                                  *dry_run)  # fmt: skip
    assert code == 1 and stdout == "" and stderr.count("\n") == 1
    expected = "a qtool-quantized file" if which == "quantized" else "a qtool qparams sidecar"
    assert expected in stderr and "already quantized" in stderr and "original" in stderr
    assert sorted(p.name for p in samples.iterdir()) == before


def test_a_quantized_sharded_checkpoint_is_refused(
    invoke: Invoke, samples: Path, tmp_path: Path
) -> None:
    out = tmp_path / "q"
    assert invoke("quantize", str(samples / "sharded-mlp"), "-o", str(out))[0] == 0
    for extra in ([], ["--dry-run"]):
        code, _, stderr = invoke("quantize", str(out), "-o", str(tmp_path / "qq"), *extra)
        assert code == 1 and "already quantized" in stderr
    assert not (tmp_path / "qq").exists()


def test_a_plain_checkpoint_is_not_taken_for_a_quantized_one(invoke: Invoke, samples: Path) -> None:
    view = HeaderView(samples / "m.safetensors", {"format": "pt"}, ["w.weight", "w.scale"])
    assert quantized_format(view) is None
    shutil.copy(samples / "mlp.safetensors", samples / "copy.safetensors")
    assert invoke("quantize", str(samples / "copy.safetensors"), "--dry-run")[0] == 0
