from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qtool import __version__
from tests.conftest import Invoke

README = Path(__file__).parents[2] / "README.md"
COMMANDS = ["quantize", "dequantize", "inspect"]
ERROR_LINE = re.compile(r"^qtool: error: .+\n$")


def qtool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real entry point in a subprocess: exit codes and streams exactly as a shell sees them."""
    return subprocess.run(
        [sys.executable, "-m", "qtool", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example_and_a_readme_mention(
    invoke: Invoke, command: str
) -> None:
    code, out, _ = invoke(command, "--help")
    assert code == 0
    assert "Example: qtool " + command in out
    assert f"qtool {command}" in README.read_text()


@pytest.mark.slow
def test_version(invoke: Invoke) -> None:
    assert invoke("--version")[1].strip() == f"qtool {__version__}"


def test_quantize_json_is_the_only_stdout(invoke: Invoke, samples: Path) -> None:
    out = samples / "m.int8.safetensors"
    code, stdout, stderr = invoke(
        "quantize", str(samples / "mlp.safetensors"), "-o", str(out), "--json"
    )
    assert code == 0, stderr
    doc = json.loads(stdout)
    assert doc["schema_version"] == 2 and doc["command"] == "quantize" and doc["ok"] is True
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert tensors["head.weight"]["out_dtype"] == "I8"
    assert isinstance(tensors["head.weight"]["sqnr_db"], float)
    assert tensors["step"]["mse"] is None
    assert doc["totals"]["quantized"] == 4 and doc["totals"]["kept"] == 7
    assert doc["outputs"] == [str(out), str(samples / "m.int8.qparams.safetensors")]


def test_quantize_default_output_name_and_table(invoke: Invoke, samples: Path) -> None:
    code, stdout, _ = invoke("quantize", str(samples / "convnet.safetensors"), "--scheme", "asym")
    assert code == 0
    assert (samples / "convnet.int8.safetensors").is_file()
    assert (samples / "convnet.int8.qparams.safetensors").is_file()
    assert "conv2.weight" in stdout and "asym int8 axis 0" in stdout
    assert "\x1b" not in stdout


def test_dequantize_and_inspect_json(invoke: Invoke, samples: Path) -> None:
    q = samples / "q.safetensors"
    assert invoke("quantize", str(samples / "mlp.pt"), "-o", str(q))[0] == 0
    code, stdout, _ = invoke("dequantize", str(q), "--json")
    assert code == 0
    assert json.loads(stdout)["outputs"] == [str(samples / "q.dequantized.safetensors")]
    doc = json.loads(invoke("inspect", str(q), "--json")[1])
    assert doc["kind"] == "quantized"
    head = next(t for t in doc["tensors"] if t["name"] == "head.weight")
    quantization = head["quantization"]
    assert quantization["scheme"] == "sym"
    assert quantization["granularity"] == {"kind": "channel", "axis": 0}
    side = json.loads(invoke("inspect", str(samples / "q.qparams.safetensors"), "--json")[1])
    assert side["kind"] == "sidecar" and side["manifest"]["format_version"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["quantize", "missing.safetensors"], "no such file"),
        (["quantize", "{samples}/notes.txt"], "not a checkpoint: plain text"),
        (["quantize", "{samples}"], "no checkpoint in this directory"),
        (["quantize", "{samples}/mlp.safetensors", "--device", "cuda"], "no CUDA device"),
        (["quantize", "{samples}/mlp.safetensors", "--axis", "5"], "out of range"),
        (["dequantize", "{samples}/mlp.safetensors"], "not a quantized file"),
        (["inspect", "{samples}/notes.txt"], "not a checkpoint: plain text"),
    ],
)
def test_bad_input_is_one_line_exit_1_and_empty_stdout(
    invoke: Invoke, samples: Path, args: list[str], message: str
) -> None:
    (samples / "notes.txt").write_text("hello, not a checkpoint")
    args = [a.format(samples=samples) for a in args]
    if "cuda" in args:
        pytest.importorskip("torch")
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is present")
    code, stdout, stderr = invoke(*args)
    assert code == 1
    assert stdout == ""
    assert ERROR_LINE.match(stderr), stderr
    assert message in stderr


def test_existing_output_without_force(invoke: Invoke, samples: Path) -> None:
    src = str(samples / "mlp.safetensors")
    assert invoke("quantize", src)[0] == 0
    code, stdout, stderr = invoke("quantize", src)
    assert code == 1 and stdout == "" and "--force" in stderr
    assert invoke("quantize", src, "--force")[0] == 0


def test_json_errors_are_json_on_stderr(invoke: Invoke, samples: Path) -> None:
    code, stdout, stderr = invoke("inspect", str(samples / "nope.safetensors"), "--json")
    assert code == 1 and stdout == ""
    err = json.loads(stderr)
    assert err["ok"] is False and err["error"]["code"] == "bad_input"


@pytest.mark.slow
def test_real_process_exit_codes_and_streams(samples: Path) -> None:
    ok = qtool("inspect", str(samples / "mlp.safetensors"), env={"FORCE_COLOR": "1"})
    assert ok.returncode == 0 and "embed.weight" in ok.stdout
    assert "\x1b" not in ok.stdout + ok.stderr  # piped: no escapes even when colour is forced
    bad = qtool("quantize", str(samples / "missing.safetensors"))
    assert bad.returncode == 1 and bad.stdout == "" and ERROR_LINE.match(bad.stderr)
    assert "Traceback" not in bad.stderr
    usage = qtool("quantize", "--scheme", "wrong", str(samples / "mlp.safetensors"))
    assert usage.returncode == 2 and usage.stdout == ""
    assert qtool("--version").stdout.strip() == f"qtool {__version__}"


HOSTILE = {
    "esc\x1b[31mred\x1b[0m.weight": torch.randn(4, 4),
    "osc\x1b]8;;http://x\x07link.weight": torch.randn(4, 4),
    "[bold]markup[/bold].weight": torch.randn(4, 4),
    "[/].weight": torch.randn(4, 4),
    "rtl\u202eoverride.weight": torch.randn(4, 4),
    "long." + "x" * 10_000: torch.randn(4, 4),
}


def test_hostile_tensor_names_cannot_drive_the_terminal(invoke: Invoke, tmp_path: Path) -> None:
    save_file(HOSTILE, tmp_path / "h.safetensors")
    for args in (
        ["quantize", str(tmp_path / "h.safetensors")],
        ["inspect", str(tmp_path / "h.int8.safetensors")],
    ):
        code, stdout, stderr = invoke(*args)
        assert code == 0, stderr
        assert "\x1b" not in stdout and "\u202e" not in stdout and "\x07" not in stdout
        assert "\\x1b[31mred" in stdout and "[bold]markup[/bold].weight" in stdout
    code, stdout, _ = invoke("inspect", str(tmp_path / "h.int8.safetensors"), "--json")
    assert {t["name"] for t in json.loads(stdout)["tensors"]} == set(HOSTILE)  # exact in JSON


@pytest.mark.slow
@pytest.mark.parametrize(
    "env",
    [
        {"NO_COLOR": "1"},
        {"TERM": "dumb"},
        {"GITHUB_ACTIONS": "true"},
        {"FORCE_COLOR": "1", "NO_COLOR": "1"},
        {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "PY_COLORS": "1"},
        {"COLUMNS": "20"},
    ],
    ids=lambda e: ",".join(e),
)
def test_no_escape_codes_off_a_terminal(samples: Path, env: dict[str, str]) -> None:
    result = qtool("quantize", str(samples / "mlp.safetensors"), "--min-sqnr", "99", env=env)
    assert result.returncode == 3
    assert "\x1b" not in result.stdout + result.stderr
    bad = qtool("inspect", str(samples / "missing.safetensors"), env=env)
    assert "\x1b" not in bad.stdout + bad.stderr and bad.returncode == 1


@pytest.mark.slow
def test_broken_pipe_is_quiet(samples: Path) -> None:
    cmd = f"{sys.executable} -m qtool inspect --json {samples / 'mlp.safetensors'} | head -c1"
    result = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr


@pytest.mark.slow
def test_piped_output_is_stable_and_has_no_trailing_spaces(samples: Path) -> None:
    first = qtool("quantize", str(samples / "mlp.safetensors"), "--dry-run").stdout
    second = qtool(
        "quantize", str(samples / "mlp.safetensors"), "--dry-run", env={"COLUMNS": "200"}
    )
    assert all(line == line.rstrip() for line in first.splitlines())
    assert "embed.weight" in second.stdout
    assert first == qtool("quantize", str(samples / "mlp.safetensors"), "--dry-run").stdout


@pytest.mark.slow
def test_sample_weights_regenerate_byte_for_byte(tmp_path: Path) -> None:
    script = README.parent / "scripts" / "make_sample_weights.py"
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, timeout=120)
    shipped = README.parent / "sample_weights"
    files = [path for path in shipped.rglob("*") if path.is_file()]
    assert len(files) > 10  # the loop below checks something
    for path in files:
        assert (tmp_path / path.relative_to(shipped)).read_bytes() == path.read_bytes(), path


@pytest.mark.slow
def test_engine_errors_carry_hints_and_the_cli_spells_them_as_options(
    invoke: Invoke, samples: Path
) -> None:
    """Lower layers name no command-line flag (a recipe or a library caller has other means);
    the CLI turns their hints into its own option names."""
    from qtool import api
    from qtool.engine.plan import QuantizeOptions
    from qtool.errors import OutputError

    src, out = samples / "mlp.safetensors", samples / "exists.safetensors"
    out.write_bytes(b"")
    with pytest.raises(OutputError) as info:
        api.quantize(src, out, QuantizeOptions(), device="cpu")
    assert "--" not in str(info.value) and info.value.hints == ("force",)
    code, stdout, stderr = invoke("quantize", str(src), "-o", str(out))
    assert code == 1 and stdout == "" and stderr.rstrip().endswith("(pass --force)")


@pytest.mark.slow
def test_piped_tables_fit_columns_and_name_the_columns_they_hide(samples: Path) -> None:
    args = ["quantize", str(samples / "mlp.safetensors"), "--dry-run", "--estimate"]
    result = qtool(*args, env={**os.environ, "COLUMNS": "80"})
    header = next(line for line in result.stdout.splitlines() if "tensor" in line)
    assert result.returncode == 0 and "shape" not in header and "SQNR" in header
    lines = [line for line in result.stdout.splitlines() if str(samples) not in line]
    assert max(len(line) for line in lines) <= 80  # a path is never broken: it may not fit
    assert "(shape, max err hidden to fit 80 columns (COLUMNS)" in result.stdout


@pytest.mark.slow
def test_commands_leave_no_reference_cycles(tmp_path: Path) -> None:
    """main() pauses the cyclic garbage collector while a command runs: that is safe only while
    the engine's work creates no reference cycles, whatever the tensor count (imports aside;
    in a fresh interpreter: other tests leave cyclic garbage of their own, matplotlib's)."""
    src = tmp_path / "m.safetensors"
    tensors = {f"l.{i}.weight": torch.randn(4, 8) for i in range(300)}
    save_file({**tensors, "big.weight": torch.randn(200, 100), "b": torch.zeros(3)}, src)
    code = f"""
import gc, sys
from pathlib import Path
from qtool import api
from qtool.engine.plan import QuantizeOptions
src, out = Path({str(src)!r}), Path({str(tmp_path)!r})
def commands():
    api.quantize(src, out / "q.safetensors", QuantizeOptions(), device="cpu", force=True)
    api.dequantize(out / "q.safetensors", out / "r.safetensors", force=True)
    api.compare(src, out / "q.safetensors")
    api.inspect(out / "q.safetensors")
commands()  # imports (torch's leave some cyclic garbage, once)
gc.collect()
gc.disable()
commands()
print(gc.collect())
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "0", result


@pytest.mark.slow
def test_main_restores_the_garbage_collector() -> None:
    import gc

    from qtool.cli import main

    assert gc.isenabled()
    with pytest.raises(SystemExit):
        main(["--version"])
    assert gc.isenabled()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["quantize", "compare"])
def test_long_tables_show_their_worst_rows_unless_asked(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """Over TABLE_MAX_ROWS rows, a table shows its TRIMMED_ROWS worst (lowest SQNR first) and
    says so; --all shows every row, --top N any number, --json carries every row."""
    from qtool.cli import options

    monkeypatch.setattr(options, "TABLE_MAX_ROWS", 10)
    monkeypatch.setattr(options, "TRIMMED_ROWS", 3)
    src, q = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    gen = torch.Generator().manual_seed(0)
    save_file({f"l.{i}.weight": torch.randn(8, 8 + i, generator=gen) for i in range(12)}, src)
    assert invoke("quantize", str(src), "-o", str(q), "--json")[0] == 0
    args = ["quantize", str(src), "-o", str(q), "--force"] if command == "quantize" else [
        "compare", str(src), str(q)]  # fmt: skip

    def names(*extra: str) -> list[str]:
        code, stdout, _ = invoke(*args, *extra)
        assert code == 0
        return re.findall(r"^\s*(l\.\d+\.weight)\s", stdout, re.MULTILINE)

    _, doc, _ = invoke(*args, "--json")
    rows = json.loads(doc)["tensors"]
    worst = [r["name"] for r in sorted(rows, key=lambda r: r["sqnr_db"])[:3]]
    assert len(rows) == 12 and names() == worst
    assert "(showing 3 of 12 tensors; --all shows every one)" in invoke(*args)[1]
    assert names("--all") == [r["name"] for r in rows]
    assert len(names("--top", "5")) == 5 and len(names("--sort", "name")) == 3
