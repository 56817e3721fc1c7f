"""Private scratch directories (io/tempdirs.private_scratch, eval's copy of the tokenizer files):
made 0700, removed on exit, and a killed run's one removed by the next run, never anything else."""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
import time
from pathlib import Path

import pytest

from qtool.io.tempdirs import SCRATCH_GRACE_S, private_scratch


@pytest.fixture
def tmpdir_(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_scratch_is_private_and_removed_on_exit(tmpdir_: Path) -> None:
    with private_scratch("eval") as scratch:
        assert scratch.parent == tmpdir_
        assert stat.S_IMODE(scratch.stat().st_mode) == 0o700
        (scratch / "tokenizer.json").write_text("{}")
    assert not scratch.exists()


def test_only_the_users_own_dead_scratches_are_removed(tmpdir_: Path) -> None:
    dead = tmpdir_ / "qtool-eval-dead0000"
    dead.mkdir()
    (dead / "tokenizer.json").write_text("{}")
    live = tmpdir_ / "qtool-eval-live0000"
    live.mkdir()
    held = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)  # a run still using it
    others = tmpdir_ / "qtool-eval-other000"
    others.mkdir()
    if os.getuid() == 0:
        os.chown(others, 54321, 54321)
    kept = [
        live,
        tmpdir_ / "qtool-calib-dead0000",  # another kind
        tmpdir_ / "qtool-eval-notes",  # not a name mkdtemp makes
        tmpdir_ / "my-qtool-eval-x0000000",
    ]
    for path in kept[1:]:
        path.mkdir()
    young = tmpdir_ / "qtool-eval-young000"  # made by another run a moment ago, not locked yet
    young.mkdir()
    old = time.time() - 2 * SCRATCH_GRACE_S
    for path in (dead, live, others):
        os.utime(path, (old, old))
    target = tmpdir_ / "target"
    target.mkdir()
    (target / "precious").write_text("x")
    link = tmpdir_ / "qtool-eval-link0000"
    link.symlink_to(target)
    try:
        with private_scratch("eval"):
            pass
    finally:
        os.close(held)
    assert not dead.exists()
    assert all(p.is_dir() for p in [*kept, young])
    assert (target / "precious").read_text() == "x" and link.is_symlink()
    assert others.exists() == (os.getuid() == 0)  # root: another uid's is left alone


@pytest.mark.parametrize(("mode", "refused"), [(0o777, True), (0o770, True), (0o1777, False)])
def test_a_temp_directory_others_can_rename_in_is_refused(
    tmpdir_: Path, mode: int, refused: bool
) -> None:
    """Callers reopen files in the scratch by path: in a parent others may write without the
    sticky bit, another user could rename the 0700 scratch away and put theirs in its place
    (the HF -> GGUF export then wrote the attacker's config and chat template, exit 0)."""
    tmpdir_.chmod(mode)
    if refused:
        with (
            pytest.raises(OSError, match="set TMPDIR to a directory only you can write"),
            private_scratch("eval"),
        ):
            pass
        assert list(tmpdir_.iterdir()) == []
    else:
        with private_scratch("eval") as scratch:
            assert scratch.is_dir()
