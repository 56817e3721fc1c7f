"""quantize HF_DIR --format gguf --dry-run plans from the checkpoint's headers and writes
nothing: it converted the whole checkpoint into a float GGUF in a scratch directory beside the
output (reading every value, writing as many bytes), then planned from that copy. Now the
conversion's checks run (config, tokenizer files, vocabulary), its header alone is built in a
memory file, and the plan is made from it: no output file is created, no scratch directory,
no tensor value read. The plan is the real run's, tensor for tensor."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Invoke
from tests.formats.gguf.hf_models import write_model

pytest.importorskip("transformers")


@pytest.fixture
def known_pre_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    from qtool.formats.gguf import hf_vocab

    # the tiny tokenizer's pre-tokenizer taken as gpt-2's (the converter's table lacks it)
    monkeypatch.setattr(hf_vocab, "pre_tokenizer", lambda directory: "gpt-2")


def _forbidden(what: str) -> Any:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a dry run {what}")

    return refuse


def _plan(invoke: Invoke, src: Path, out: Path, *mode: str) -> list[tuple[str, str, str, int]]:
    code, stdout, err = invoke(
        "quantize", str(src), "--format", "gguf", "--dtype", "Q4_K", "-o", str(out),
        "--json", *mode,
    )  # fmt: skip
    assert code == 0, err
    rows = json.loads(stdout)["tensors"]
    return [(r["name"], r["dtype"], r["out_dtype"], r["bytes_in"]) for r in rows]


@pytest.mark.usefixtures("known_pre_tokenizer")
def test_dry_run_reads_no_value_and_writes_no_file(
    tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors

    from qtool.engine import hf_gguf
    from qtool.io.atomic import OutputSet
    from qtool.io.checkpoint import Checkpoint

    src = write_model(tmp_path / "m", "llama")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    real = _plan(invoke, src, out_dir / "real.gguf")  # the run the plan must match
    before = {d: sorted(os.listdir(d)) for d in (src, out_dir)}
    with monkeypatch.context() as m:
        m.setattr(safetensors, "safe_open", _forbidden("read a tensor's values"))
        m.setattr(Checkpoint, "_read", _forbidden("read a tensor's values"))  # qtool's pread
        m.setattr(OutputSet, "create", _forbidden("created a file"))
        m.setattr(hf_gguf, "scratch_beside", _forbidden("made a scratch directory"))
        planned = _plan(invoke, src, out_dir / "o.gguf", "--dry-run")
    assert planned == real
    assert {d: sorted(os.listdir(d)) for d in before} == before


@pytest.mark.usefixtures("known_pre_tokenizer")
def test_dry_run_makes_the_conversions_checks(tmp_path: Path, invoke: Invoke) -> None:
    src = write_model(tmp_path / "m", "qwen2")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["add_bos_token"] = "yes"
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    code, stdout, err = invoke(
        "quantize", str(src), "--format", "gguf", "--dtype", "Q4_K",
        "-o", str(tmp_path / "o.gguf"), "--dry-run",
    )  # fmt: skip
    assert code == 1 and stdout == "", err
    assert "tokenizer_config.json" in err and "add_bos_token" in err
