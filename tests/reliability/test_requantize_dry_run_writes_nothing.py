"""`quantize X.gguf --allow-requantize --dry-run`: a plan writes nothing, as every dry run
(docs/cli.md), though the real run dequantizes into a scratch F32 copy: run under a file-size
limit of 0 bytes, which any file written would exceed, it succeeds and nothing is left beside
the input or the output. Every requantize report (plan, --estimate, the real run) describes
the input as it is: its tensors' own ggml types and bytes, not those of the F32 copy."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qtool.io.gguf_file import GGUFFile
from tests import gguf_models as M
from tests.conftest import Invoke

pytest.importorskip("gguf")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Q8_0 GGUF qtool quantized from the tiny llama's BF16 GGUF, alone in its directory."""
    from qtool import api
    from qtool.spec import FormatName, gguf_spec

    d = M.make_hf_llama(tmp_path_factory.mktemp("tiny"))
    bf16 = M.write_float_gguf(d, d / "bf16.gguf", "BF16")
    out = tmp_path_factory.mktemp("q8") / "model.Q8_0.gguf"
    options = api.QuantizeOptions(gguf_spec("Q8_0"), format=FormatName.GGUF)
    api.quantize(bf16, out, options)
    return out


def _no_file_written() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


@pytest.mark.parametrize("beside_input", [True, False])
def test_a_requantize_plan_writes_no_file(q8: Path, tmp_path: Path, beside_input: bool) -> None:
    out_dir = q8.parent if beside_input else tmp_path
    before = {d: sorted(os.listdir(d)) for d in (q8.parent, out_dir)}
    args = ["quantize", str(q8), "--format", "gguf", "--dtype", "Q4_K", "--allow-requantize"]
    proc = subprocess.run(
        [sys.executable, "-m", "qtool", *args, "-o", str(out_dir / "r.gguf"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_no_file_written,
    )
    assert proc.returncode == 0, proc.stderr
    assert {d: sorted(os.listdir(d)) for d in before} == before


@pytest.mark.parametrize("mode", [["--dry-run"], ["--dry-run", "--estimate"], []])
def test_a_requantize_report_describes_the_input_not_the_f32_copy(
    invoke: Invoke, q8: Path, tmp_path: Path, mode: list[str]
) -> None:
    code, stdout, err = invoke(
        "quantize", str(q8), "--format", "gguf", "--dtype", "Q4_K", "-o",
        str(tmp_path / "r.gguf"), "--allow-requantize", "--json", *mode,
    )  # fmt: skip
    assert code == 0, err
    with GGUFFile(q8) as f:
        infos = f.header.by_name()
    summary = json.loads(stdout)
    assert summary["dry_run"] is bool(mode) and summary["inputs"] == [str(q8)]
    rows = {t["name"]: (t["dtype"], t["bytes_in"]) for t in summary["tensors"]}
    assert rows == {n: (i.type.name, i.nbytes) for n, i in infos.items()}
    assert "Q8_0" in {dtype for dtype, _ in rows.values()}
    assert summary["totals"]["bytes_in"] == sum(i.nbytes for i in infos.values())
    assert sorted(os.listdir(tmp_path)) == ([] if mode else ["r.gguf"])
