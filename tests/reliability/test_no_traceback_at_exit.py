"""Issue 28, class 4: no traceback, ever, at the edges of a run. A SIGINT or SIGTERM after the
outputs are published and the report printed (the interpreter's shutdown takes about a second,
freeing torch) interrupts nothing: the process ends with its own code and no more output (one
line and 143/130 while the report is still being written). And an exception
that is not an Exception (pyo3's PanicException, raised by the tokenizers library on a Rust
panic, derives from BaseException) is qtool's "internal error" line, JSON under --json."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qtool.cli import main

SAMPLES = Path(__file__).parents[2] / "sample_weights"
TRIES = 6  # each signal sent the moment "wrote" is read; before the fix most tries printed one


COMMANDS = {  # (arguments before -o, tries): a command that loads transformers as well
    "quantize": (["quantize", str(SAMPLES / "mlp.safetensors")], TRIES),
    "calibrate": (["calibrate", str(SAMPLES / "tiny-lm"), "--tokens", "128", "--ctx", "64"], 3),
}


def _signal_after_wrote(args: list[str], out: Path, signum: int) -> tuple[int, str]:
    """Run `qtool ARGS -o OUT` with stdout on a terminal (line by line, as a user sees it), send
    `signum` as soon as its last line ("wrote ...") is read; its exit status and stderr."""
    leader, follower = pty.openpty()
    with subprocess.Popen(
        [sys.executable, "-m", "qtool", *args, "-o", str(out), "--force"],
        stdout=follower,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not ignored (`&`)
    ) as proc:
        os.close(follower)
        seen = b""
        try:
            while b"wrote" not in seen:
                chunk = os.read(leader, 65536)
                if not chunk:
                    break
                seen += chunk
        except OSError:  # the terminal closed: the run ended before its last line was read
            pass
        finally:
            proc.send_signal(signum)
            assert proc.stderr is not None
            err = proc.stderr.read().decode()
            proc.wait(timeout=120)
            os.close(leader)
    assert b"wrote" in seen, err
    return proc.returncode, err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_after_the_outputs_are_written_prints_nothing(
    tmp_path: Path, signum: int, command: str
) -> None:
    args, tries = COMMANDS[command]
    suffix = ".imatrix.gguf" if command == "calibrate" else ".safetensors"
    for i in range(tries):
        out = tmp_path / f"out{i}{suffix}"
        code, err = _signal_after_wrote(args, out, signum)
        assert "Traceback" not in err and "Exception ignored" not in err, err
        if err:  # caught while the report's last line was still being written
            assert err.startswith(("qtool: error: terminated", "qtool: error: interrupted"))
            assert len(err.splitlines()) == 1 and code == 128 + signum, (code, err)
        else:  # its own code, or (Typer's, for a SIGINT while the report is written) the
            # conventional one
            assert code in (0, 128 + signum), code
        assert out.is_file()


class PanicException(BaseException):
    """What pyo3 raises for a Rust panic: not an Exception."""


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_base_exception_from_a_library_is_an_internal_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    def panics(**kwargs: object) -> None:
        raise PanicException("called `Result::unwrap()` on an `Err` value")

    monkeypatch.setattr(sys.modules["qtool.cli.app"], "app", panics)
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "x", *(["--json"] if as_json else [])])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    if as_json:
        error = json.loads(captured.err)["error"]
        assert error["code"] == "internal"
        assert "PanicException: called `Result::unwrap()`" in error["message"]
    else:
        assert captured.err.startswith("qtool: error: internal error: PanicException: called")
        assert len(captured.err.splitlines()) == 1
