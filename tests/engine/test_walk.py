"""The walk of one tensor from the command line to the file (docs/development.md, "One tensor
from the command line to the file"): the qtool modules on the stack where the kernel computes
the codes and where the format's writer hands the codes to the file are the table's, in its
order. A layer added
to the walk (a shim, a dispatch stacked on a dispatch) fails here until the docs say so."""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import qtool
from qtool.cli.app import main
from qtool.io.writer import StreamingWriter
from qtool.numerics import kernels

DOCS = Path(__file__).parents[2] / "docs" / "development.md"
SECTION = "## One tensor from the command line to the file"
WORDS = {7: "Seven", 8: "Eight", 9: "Nine", 10: "Ten", 11: "Eleven"}


def _documented() -> list[str]:
    """The module column of the section's table, in order."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index(SECTION) :].split("\n## ", 1)[0]
    return re.findall(r"^\| \d+ \| (\S+\.py) \|", section, flags=re.MULTILINE)


def _count_sentence() -> str:
    text = DOCS.read_text(encoding="utf-8")
    return text[text.index(SECTION) :].split("\n## ", 1)[0]


def _modules(stacks: list[traceback.StackSummary]) -> list[str]:
    """qtool's modules on the stacks (paths below the package), each once, in call order."""
    root = str(Path(qtool.__file__).parent) + "/"
    seen: list[str] = []
    for stack in stacks:
        for frame in stack:
            if frame.filename.startswith(root):
                module = frame.filename[len(root) :]
                if module not in seen:
                    seen.append(module)
    return seen


def test_one_tensor_walks_the_documented_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "big.safetensors"
    save_file({"w": torch.randn(256, 256, generator=torch.Generator().manual_seed(0))}, src)
    monkeypatch.setenv("QTOOL_KERNEL", "torch")
    at_kernel: list[traceback.StackSummary] = []
    at_write: list[traceback.StackSummary] = []

    def recording(real: Callable[..., object], into: list[traceback.StackSummary]) -> object:
        def call(*args: object, **kwargs: object) -> object:
            into.append(traceback.extract_stack())
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(kernels, "_quantize_rows", recording(kernels._quantize_rows, at_kernel))
    monkeypatch.setattr(StreamingWriter, "write", recording(StreamingWriter.write, at_write))
    with pytest.raises(SystemExit) as done:
        main(["quantize", str(src), "-o", str(tmp_path / "q.safetensors")])
    assert done.value.code == 0
    # the codes' write (the sidecar's writes come from the writer's finish)
    codes = [s for s in at_write if any(f.name == "quantized" for f in s)]
    assert len(at_kernel) == 1 and len(codes) == 1
    walked = _modules([*at_kernel, *codes])
    assert walked == _documented()
    assert f"{WORDS[len(walked)]} modules" in _count_sentence()
