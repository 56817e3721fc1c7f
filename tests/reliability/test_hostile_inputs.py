"""Hostile inputs and hostile surroundings (issue 9, items 8-10 and 13-17): files that change
while read, formats that look alike, torch's warnings, closed or full standard streams,
undecodable names, interruptions after the commit. The one-line cases live in tests/corpus.py."""

from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from qtool import api
from qtool.cli import app
from qtool.engine.plan import QuantizeOptions
from qtool.formats.qtool.manifest import SIDECAR_KEY, sidecar_path
from qtool.io.checkpoint import open_checkpoint
from qtool.io.stformat import read_header

cli = importlib.import_module(
    "qtool.cli.app"
)  # the module; qtool.cli.app as an attribute is the app
cli_errors = importlib.import_module("qtool.cli.errors")


def _run(*args: str, preexec: object = None, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qtool", *args],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=preexec,  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


def _weights(path: Path, n: int = 2, shape: tuple[int, int] = (64, 32)) -> None:
    gen = torch.Generator().manual_seed(0)
    save_file({f"l{i}.weight": torch.randn(*shape, generator=gen) for i in range(n)}, path)


# ---- 9.10: a file truncated while it is read ------------------------------------------------


_TRUNCATE_OPEN = """
import os, sys
from pathlib import Path
from qtool.io.checkpoint import open_checkpoint
from qtool.errors import InputError
ckpt = open_checkpoint(Path(sys.argv[1]))
os.truncate(sys.argv[1], ckpt.entries[0].end // 2)
for read in (ckpt.tensor, ckpt.raw):
    try:
        read(ckpt.entries[-1])
    except InputError as err:
        print(err)
"""


@pytest.mark.slow
def test_truncated_while_reading_is_an_error_not_sigbus(tmp_path: Path) -> None:
    """In a child: a regression to mapped reads dies of SIGBUS there, not in the test runner."""
    src = tmp_path / "m.safetensors"
    _weights(src)
    proc = subprocess.run(
        [sys.executable, "-c", _TRUNCATE_OPEN, str(src)], capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and all("changed while reading" in line for line in lines), lines


_TRUNCATE_MID_RUN = """
import os, sys
from pathlib import Path
from qtool.cli import main
from qtool.numerics import kernels
src = Path(sys.argv[1])
real = kernels.quantize_tensor
def truncating(x, *args, **kwargs):
    os.truncate(src, 100)  # another process cuts the file while qtool reads it
    return real(x, *args, **kwargs)
kernels.quantize_tensor = truncating
sys.argv = ["qtool", "quantize", str(src), "-o", sys.argv[2]]
main()
"""


@pytest.mark.slow
def test_truncated_mid_run_reports_and_cleans_up(tmp_path: Path) -> None:
    """In a child process: before the fix the mapped read died of SIGBUS, leaving a temp."""
    src = tmp_path / "m.safetensors"
    _weights(src, n=4, shape=(256, 128))  # not tiny: each is read just before it is quantized
    proc = subprocess.run(
        [sys.executable, "-c", _TRUNCATE_MID_RUN, str(src), str(tmp_path / "q.safetensors")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert "changed while reading" in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


# ---- 9.13: parameters and requires_grad ------------------------------------------------------


def test_named_parameters_quantize_like_plain_weights(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    torch.save(dict(model.named_parameters()), tmp_path / "p.pt")
    torch.save({"w": torch.randn(4, 4, requires_grad=True)}, tmp_path / "g.pt")
    for name in ("p.pt", "g.pt"):
        out = tmp_path / f"{name}.safetensors"
        result = CliRunner().invoke(app, ["quantize", str(tmp_path / name), "-o", str(out)])
        assert result.exit_code == 0, result.stderr
        assert result.stderr == ""
    restored = load_file(tmp_path / "p.pt.safetensors")
    assert restored["0.weight"].dtype == torch.int8


# ---- 9.15: safetensors named .bin whose header length looks like a pickle's PROTO ------------


def _safetensors_with_header_length(path: Path, low_byte: int) -> None:
    tensors = {"w": torch.randn(4, 4)}
    doc = {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}
    text = json.dumps(doc).encode()
    text += b" " * ((low_byte - len(text)) % 256)
    assert len(text) % 256 == low_byte
    path.write_bytes(struct.pack("<Q", len(text)) + text + tensors["w"].numpy().tobytes())


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(low_byte=st.sampled_from([0x80, 0x50, 0x4B, 0x00, 0x7B]), suffix=st.sampled_from(
    [".bin", ".pt", ".pth", ".safetensors"]))  # fmt: skip
def test_safetensors_is_recognised_by_content_whatever_its_first_byte(
    tmp_path_factory: pytest.TempPathFactory, low_byte: int, suffix: str
) -> None:
    path = tmp_path_factory.mktemp("sniff") / f"m{suffix}"
    _safetensors_with_header_length(path, low_byte)
    ckpt = open_checkpoint(path)
    try:
        assert [e.name for e in ckpt.entries] == ["w"]
        assert ckpt.metadata is None and ckpt.skipped == []
    finally:
        ckpt.close()
    result = CliRunner().invoke(app, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["tensors"][0]["name"] == "w"


# ---- 9.16: torch's warnings -------------------------------------------------------------------


@pytest.mark.slow
def test_torch_warnings_are_one_qtool_line_each(tmp_path: Path) -> None:
    with pytest.warns(UserWarning):
        torch.save({"w": torch.eye(3).to_sparse_csr()}, tmp_path / "csr.pt")
    proc = _run("inspect", str(tmp_path / "csr.pt"))
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert all(line.startswith("qtool: ") for line in lines), proc.stderr
    assert any(line.startswith("qtool: warning: torch: Sparse CSR") for line in lines)
    assert lines[-1].startswith("qtool: error: ")


# ---- 9.14: names and metadata -----------------------------------------------------------------


@pytest.mark.slow
def test_undecodable_file_names_reach_json_as_escapes(tmp_path: Path) -> None:
    src = tmp_path / "n\udcff.safetensors"  # the file name holds the byte 0xff
    _weights(src)
    out = tmp_path / "q.safetensors"
    result = CliRunner().invoke(app, ["quantize", str(src), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    assert "\\udcff" in result.stdout
    assert json.loads(result.stdout)["inputs"] == [str(src)]
    proc = _run("inspect", str(src), "--json")
    assert proc.returncode == 0, proc.stderr
    proc = _run("inspect", str(src))
    assert proc.returncode == 0 and "n\\udcff" in proc.stdout, proc.stderr


@pytest.mark.parametrize("name", ["/etc/passwd", "a/b", "..", "x\\\\y"])
def test_sidecar_name_in_metadata_must_be_a_plain_file_name(tmp_path: Path, name: str) -> None:
    src, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    _weights(src)
    api.quantize(src, out, QuantizeOptions(), device="cpu")
    header = read_header(out)
    save_file(load_file(out), out, metadata={**(header.metadata or {}), SIDECAR_KEY: name})
    result = CliRunner().invoke(app, ["inspect", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert any("not a plain file name" in note for note in doc["notes"])
    assert doc["tensors"][0]["quantization"]["scheme"] == "sym"  # found the default sidecar


# ---- 9.14: standard streams, threads, internal errors -----------------------------------------


@pytest.mark.slow
def test_closed_stdout_writes_outputs_and_says_the_report_is_lost(tmp_path: Path) -> None:
    src, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    _weights(src)
    proc = subprocess.run(
        [sys.executable, "-m", "qtool", "quantize", str(src), "-o", str(out), "--json"],
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.close(1),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "qtool: warning: stdout is closed; the report is discarded\n"
    read_header(out)  # complete, and the report did not land in it
    assert load_file(out)["l0.weight"].dtype == torch.int8


@pytest.mark.slow
def test_closed_stderr_runs_and_keeps_stdout_clean(tmp_path: Path) -> None:
    """Before: exit 1 with no output at all. The skipped-entry warning must not reach stdout."""
    torch.save({"w": torch.randn(8, 8), "epoch": 3}, tmp_path / "m.pt")
    out = tmp_path / "q.safetensors"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "qtool",
            "quantize",
            str(tmp_path / "m.pt"),
            "-o",
            str(out),
            "--json",
        ],
        stdout=subprocess.PIPE,
        timeout=300,
        preexec_fn=lambda: os.close(2),
    )
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["skipped_non_tensors"] == ["epoch"]
    assert load_file(out)["w"].dtype == torch.int8


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("as_json", [True, False], ids=["json", "table"])
def test_full_stdout_is_one_line_after_complete_outputs(tmp_path: Path, as_json: bool) -> None:
    src, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    _weights(src)
    args = [sys.executable, "-m", "qtool", "quantize", str(src), "-o", str(out)]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            args + (["--json"] if as_json else []),
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "No space left on device" in proc.stderr, proc.stderr
    assert "internal error" not in proc.stderr
    if as_json:
        assert json.loads(proc.stderr)["error"]["code"] == "output"
    read_header(out)
    read_header(sidecar_path(out))


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (100 * 1024, 100 * 1024))


@pytest.mark.slow
def test_dequantize_to_pt_on_a_full_disk_is_one_line(tmp_path: Path) -> None:
    src, q = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    save_file({"w": torch.randn(256, 256)}, src)
    api.quantize(src, q, QuantizeOptions(), device="cpu")
    proc = _run("dequantize", str(q), "-o", str(tmp_path / "d.pt"), preexec=_limit_file_size)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(f"qtool: error: {tmp_path / 'd.pt'}: cannot write"), proc.stderr
    assert "internal error" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "m.safetensors", "q.qparams.safetensors", "q.safetensors"
    ]  # fmt: skip


def test_internal_errors_are_json_with_a_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(**kwargs: object) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "app", broken)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["inspect", "x", "--json"])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    error = json.loads(captured.err)["error"]
    assert error["code"] == "internal" and "ZeroDivisionError: a bug" in error["message"]


# ---- 9.17: interruptions tell the truth --------------------------------------------------------


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "text"])
def test_sigterm_after_the_commit_names_the_written_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_json: bool
) -> None:
    src, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    _weights(src)

    def terminated_while_plotting(*args: object, **kwargs: object) -> None:
        raise cli_errors.Terminated

    import qtool.engine.plots

    monkeypatch.setattr(qtool.engine.plots, "plot_quantize", terminated_while_plotting)
    args = ["quantize", str(src), "-o", str(out), "--plot", str(tmp_path / "p.png")]
    result = CliRunner().invoke(app, args + (["--json"] if as_json else []))
    assert result.exit_code == 143
    assert out.exists() and sidecar_path(out).exists()
    assert "no output was written" not in result.stderr
    assert str(out) in result.stderr and "were written" in result.stderr
    if as_json:
        assert json.loads(result.stderr)["error"]["code"] == "terminated"


def test_sigterm_before_the_commit_says_nothing_was_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(typer.Exit) as info, cli_errors.user_errors(True):
        raise cli_errors.Terminated
    assert info.value.exit_code == 143
    error = json.loads(capsys.readouterr().err)["error"]
    assert error == {
        "message": "terminated; no output was written",
        "code": "terminated",
        "path": None,
        "tensor": None,
    }
