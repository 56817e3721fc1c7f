"""A dry run makes every check the real run makes before it reads a tensor: where the real run
refuses its outputs or its device, the dry run refuses with the same message and exit code
(it used to print "would write" and exit 0), for a file output and a directory output, for a
plan from headers (--dry-run) and for an estimate (--estimate)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import SAMPLES, Invoke

Case = Callable[[Path], tuple[list[str], str]]


def _missing_parent(tmp: Path) -> tuple[list[str], str]:
    return ["-o", str(tmp / "missing" / "out.safetensors")], "does not exist; create it first"


def _existing_file(tmp: Path) -> tuple[list[str], str]:
    (tmp / "out.safetensors").write_bytes(b"mine")
    return ["-o", str(tmp / "out.safetensors")], "already exists"


def _missing_parent_of_a_directory(tmp: Path) -> tuple[list[str], str]:
    return [str(tmp / "llama"), "-o", str(tmp / "missing" / "out")], "does not exist"


def _nonempty_directory(tmp: Path) -> tuple[list[str], str]:
    (tmp / "out").mkdir()
    (tmp / "out" / "notes.txt").write_text("mine")
    return [str(tmp / "llama"), "-o", str(tmp / "out")], "not empty"


def _inside_the_input(tmp: Path) -> tuple[list[str], str]:
    return [str(tmp / "llama"), "-o", str(tmp / "llama" / "out")], "inside the input directory"


def _no_gpu(tmp: Path) -> tuple[list[str], str]:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is available here")
    return ["-o", str(tmp / "out.safetensors"), "--device", "cuda"], "no CUDA device"


CASES: dict[str, Case] = {
    "missing-parent": _missing_parent,
    "existing-file": _existing_file,
    "directory-missing-parent": _missing_parent_of_a_directory,
    "directory-not-empty": _nonempty_directory,
    "directory-inside-input": _inside_the_input,
    "no-gpu": _no_gpu,
}


@pytest.mark.parametrize("dry", ["plan", "estimate"])
@pytest.mark.parametrize("case", CASES)
def test_a_dry_run_refuses_what_the_real_run_refuses(
    invoke: Invoke, tmp_path: Path, case: str, dry: str
) -> None:
    shutil.copytree(SAMPLES / "tiny-llama", tmp_path / "llama")
    args, message = CASES[case](tmp_path)
    src = [] if args[0] != "-o" else [str(SAMPLES / "mlp.safetensors")]
    real = invoke("quantize", *src, *args)
    assert real[0] == 1 and message in real[2], real
    flags = ["--dry-run"] if dry == "plan" else ["--dry-run", "--estimate"]
    code, out, err = invoke("quantize", *src, *args, *flags)
    assert (code, out, err) == real


def test_a_dry_run_to_a_good_place_still_writes_nothing(invoke: Invoke, tmp_path: Path) -> None:
    code, out, _ = invoke("quantize", str(SAMPLES / "tiny-llama"), "-o", str(tmp_path / "o"),
                          "--dry-run")  # fmt: skip
    assert code == 0 and "would write" in out and not list(tmp_path.iterdir())
