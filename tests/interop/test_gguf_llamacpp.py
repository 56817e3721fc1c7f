"""llama.cpp itself loads and runs the GGUF files `qtool quantize --format gguf` writes, through
node-llama-cpp's prebuilt llama.cpp and scripts/llamacpp_check.mjs. Skipped unless `node` is on
PATH and resolves node-llama-cpp (from NODE_PATH, e.g. NODE_PATH=/tmp/nlc/node_modules after
`npm i -E node-llama-cpp@3.21.1` there); CI installs neither."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import gguf_models as M
from tests.conftest import Invoke

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "llamacpp_check.mjs"


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    found = subprocess.run(
        [node, "-e", "require.resolve('node-llama-cpp')"],
        capture_output=True, check=False, timeout=60,
    )  # fmt: skip
    if found.returncode != 0:
        pytest.skip("node-llama-cpp does not resolve (set NODE_PATH to its node_modules)")
    return node


RUNS = [["--dtype", "Q8_0"], ["--dtype", "Q4_K"], ["--target-sqnr", "24"]]


@pytest.mark.parametrize("args", RUNS)
def test_llama_cpp_loads_and_runs_what_qtool_quantize_writes(
    invoke: Invoke, tmp_path: Path, args: list[str]
) -> None:
    node = _node()
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    hf = M.make_hf_llama(tmp_path)
    src = M.write_float_gguf(hf, tmp_path / "f16.gguf", "F16")
    out = tmp_path / "out.gguf"
    code, _, err = invoke("quantize", str(src), "--format", "gguf", "-o", str(out), *args)
    assert code == 0, err
    done = subprocess.run(
        [node, str(SCRIPT), "--threads", "1", "--tokens", "4", "--decode", "4", str(out)],
        capture_output=True, text=True, check=False, timeout=300, cwd=tmp_path,
        env={**os.environ, "NODE_PATH": os.environ.get("NODE_PATH", "")},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    row = json.loads(done.stdout.splitlines()[1])
    assert row["load"] == "ok", row
    assert "error" not in row, row
    assert "answer" in row and row["decodeTokens"] == 4, row
    assert 1.0 < row["ppl"] < 10 * 128, row  # finite; a random model over a 128-token vocabulary
    assert not [w for w in row["warnings"] if not w.startswith("warn: llama_context: n_ctx_seq")]
