"""`qtool calibrate` from the command line: the JSON summary says what was written and from which
text (its SHA-256 is the text's), the output is replaced only with --force, and --merge joins
files with their datasets in order."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.conftest import Invoke

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tests.eval_models import build  # noqa: E402

TEXT = "A short calibration text, repeated until it fills a few windows. " * 30


@pytest.mark.filterwarnings("always")  # the same-text merge's warning, shown as the CLI shows it
def test_json_summary_force_and_merge(tmp_path: Path, invoke: Invoke) -> None:
    model = build(tmp_path / "llama", "llama")
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    out = tmp_path / "llama.imatrix.gguf"
    args = ["calibrate", str(model), "--text", str(text), "--tokens", "300", "--ctx", "64"]
    rc, stdout, err = invoke(*args, "-o", str(out), "--json")
    assert rc == 0, err
    doc = json.loads(stdout)
    assert doc["command"] == "calibrate" and doc["ok"] is True
    assert (doc["windows"], doc["tokens"], doc["ctx"], doc["blocks"]) == (4, 256, 64, 2)
    assert doc["entries"] == 14 and doc["output"] == str(out) and out.is_file()
    sha = hashlib.sha256(TEXT.encode()).hexdigest()
    assert doc["datasets"] == [{"name": str(text), "sha256": sha, "tokens": 256}]
    assert doc["tokens_per_second"] > 0 and doc["peak_block_bytes"] > 0

    rc, stdout, err = invoke(*args, "-o", str(out))
    assert rc == 1 and stdout == "" and "--force" in err
    rc, _, err = invoke(*args, "-o", str(out), "--force")
    assert rc == 0, err

    merged = tmp_path / "merged.gguf"
    again = tmp_path / "again.imatrix.gguf"  # another machine's run over the same text
    again.write_bytes(out.read_bytes())
    rc, stdout, err = invoke("calibrate", "--merge", str(out), str(again), "-o", str(merged),
                             "--json")  # fmt: skip
    assert rc == 0 and "were both made from the same text" in err, err
    doc = json.loads(stdout)
    assert doc["merged"] == [str(out), str(again)] and doc["chunk_count"] == 8
    assert [d["sha256"] for d in doc["datasets"]] == [sha, sha]
