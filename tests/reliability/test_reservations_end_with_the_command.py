"""An output name a command's preflight reserves (free, no --force: never replaced at the
commit) is that command's alone. A command that fails after its checks, or a dry run, left
its names reserved for the life of the process: a later command (or a library caller
rewriting its own file) in the same process was refused at that name ("appeared while this
run was writing") where a fresh process replaces it; a directory made later that reuses the
old one's inode inherited them too. Each command now starts with no reservation and drops its
own when it ends; within it, the no-replace commit is unchanged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qtool import api
from qtool.errors import OutputError
from qtool.io import atomic
from qtool.io.atomic import OutputSet, write_file
from tests.conftest import run_qtool
from tests.outputs import checkpoint, leftovers

_REWRITE = """
import sys
from pathlib import Path
from qtool.io.atomic import write_file
write_file(Path(sys.argv[1]), b"new")
"""


def _rewrite_in_a_fresh_process(final: Path) -> bytes:
    subprocess.run([sys.executable, "-c", _REWRITE, str(final)], check=True, timeout=120)
    return final.read_bytes()


@pytest.mark.parametrize("first", ["fails", "dry-run"])
def test_a_later_write_in_the_process_is_judged_as_in_a_fresh_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    src, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    checkpoint(src, tensors=1, rows=32, cols=32)
    if first == "fails":  # after the output checks, at the first file it writes (a full disk)

        def full(self: OutputSet, final: Path, *, last: bool = False) -> None:
            raise OutputError(final, "cannot write: no space left on device")

        monkeypatch.setattr(OutputSet, "create", full)
    args = ["--dry-run"] if first == "dry-run" else []
    code, _, err = run_qtool("quantize", str(src), "-o", str(out), *args)
    monkeypatch.undo()
    assert code == (1 if first == "fails" else 0), err
    assert not out.exists()
    out.write_bytes(b"old")
    write_file(out, b"new")  # a library caller rewriting its own file: no preflight of it
    assert out.read_bytes() == b"new"
    out.write_bytes(b"old")
    assert _rewrite_in_a_fresh_process(out) == b"new"
    assert leftovers(tmp_path) == []


def test_a_command_sees_no_earlier_commands_reservation(tmp_path: Path) -> None:
    final = tmp_path / "a.bin"
    with api.one_command():
        atomic.preflight([final], [], force=False)  # ... and the command fails here
    final.write_bytes(b"old")
    with api.one_command(), OutputSet() as outputs:
        outputs.create(final).write(b"new")
        outputs.commit()
    assert final.read_bytes() == b"new" and leftovers(tmp_path) == []


def test_within_a_command_the_reservation_still_holds(tmp_path: Path) -> None:
    final = tmp_path / "a.bin"
    with api.one_command():
        atomic.preflight([final], [], force=False)
        with OutputSet() as outputs:
            outputs.create(final).write(b"ours")
            final.write_bytes(b"theirs")
            with pytest.raises(OutputError, match="appeared while this run was writing"):
                outputs.commit()
    assert final.read_bytes() == b"theirs" and leftovers(tmp_path) == []
