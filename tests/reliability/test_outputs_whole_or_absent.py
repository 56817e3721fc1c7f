"""Outputs appear whole or not at all: a full disk or a failed fsync at any write, a file or
directory that appears or is swapped during the export, two runs on one output, locks that do
nothing, the final swap failing. Afterwards `-o` holds the previous output or the new one,
complete, and no temp file outlives the run that made it (the next run removes a dead run's).
Kills and signals: test_outputs_whole_after_kills.py."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qtool import api
from qtool.cli import app
from qtool.engine.plan import QuantizeOptions
from qtool.errors import OutputError
from qtool.formats.qtool.manifest import sidecar_path
from qtool.io import atomic, outcheck, outdir, renames
from qtool.io.atomic import remove_stale_temps
from tests.conftest import SAMPLES
from tests.conftest import run_qtool as invoke
from tests.outputs import CT, checkpoint, leftovers


class _FaultyFile:
    """A file whose `fail_at`-th write (counted across all outputs of a run) raises."""

    calls = 0

    def __init__(self, inner: object, fail_at: int, code: int) -> None:
        self._inner, self._fail_at, self._code = inner, fail_at, code

    def write(self, data: bytes) -> int:
        _FaultyFile.calls += 1
        if _FaultyFile.calls == self._fail_at:
            raise OSError(self._code, os.strerror(self._code))
        return self._inner.write(data)  # type: ignore[attr-defined, no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def _run_with_faults(mp: pytest.MonkeyPatch, src: Path, out: Path, fail_at: int, code: int) -> None:
    from qtool.io.atomic import OutputSet

    create = OutputSet.create
    _FaultyFile.calls = 0

    def faulty(self: OutputSet, final: Path, *, last: bool = False) -> object:
        return _FaultyFile(create(self, final, last=last), fail_at, code)

    mp.setattr(OutputSet, "create", faulty)
    api.quantize(src, out, QuantizeOptions(), device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EIO])
def test_disk_full_at_every_write_leaves_nothing(tmp_path: Path, code: int) -> None:
    """Inject an OSError at write call k for every k a quantize run makes."""
    src, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    checkpoint(src)
    with pytest.MonkeyPatch.context() as mp:
        _run_with_faults(mp, src, tmp_path / "probe.safetensors", 0, code)
    total = _FaultyFile.calls
    for p in (tmp_path / "probe.safetensors", sidecar_path(tmp_path / "probe.safetensors")):
        p.unlink()
    assert total > 3
    for k in range(1, total + 1):
        with pytest.MonkeyPatch.context() as mp, pytest.raises(OutputError) as info:
            _run_with_faults(mp, src, out, k, code)
        if code == errno.ENOSPC:
            assert "no space left on device" in str(info.value)
        assert str(out) in str(info.value) or str(sidecar_path(out)) in str(info.value)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"], k


def test_fsync_failure_leaves_nothing(tmp_path: Path) -> None:
    checkpoint(tmp_path / "m.safetensors")

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", failing)
        with pytest.raises(OutputError, match="cannot write"):
            api.quantize(
                tmp_path / "m.safetensors", tmp_path / "q.safetensors", QuantizeOptions(),
                device="cpu",
            )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_output_mode_follows_umask(tmp_path: Path) -> None:
    checkpoint(tmp_path / "m.safetensors", tensors=1)
    for umask in (0o022, 0o077):
        old = os.umask(umask)
        try:
            out = tmp_path / f"q{umask}.safetensors"
            api.quantize(tmp_path / "m.safetensors", out, QuantizeOptions(), device="cpu")
        finally:
            os.umask(old)
        assert out.stat().st_mode & 0o777 == 0o666 & ~umask
        assert sidecar_path(out).stat().st_mode & 0o777 == 0o666 & ~umask


def _hold_temp(directory: Path) -> subprocess.Popen[str]:
    """Another live run: a process holding an OutputSet temp in `directory` until killed."""
    code = (
        "import sys, time; from pathlib import Path; from qtool.io.atomic import OutputSet; "
        "o = OutputSet(); o.create(Path(sys.argv[1]) / 'q.safetensors'); "
        "print('ready', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(directory)], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def _dead_pid() -> str:
    return subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip


@pytest.mark.slow
def test_stale_temps_of_dead_runs_are_removed(tmp_path: Path) -> None:
    checkpoint(tmp_path / "m.safetensors", tensors=1)
    stale = tmp_path / f".q.safetensors.qtool-tmp-{_dead_pid()}-abcd1234"
    stale.write_bytes(b"half a file")
    live = _hold_temp(tmp_path)
    try:
        held = [p for p in tmp_path.iterdir() if p.name.startswith(".q.safetensors.qtool-tmp")]
        held.remove(stale)
        # A live run in another PID namespace: its PID means nothing here. Rename its temp to a
        # PID that is gone; only its lock says it is alive.
        other_ns = tmp_path / f".q.safetensors.qtool-tmp-{_dead_pid()}-0123abcd"
        held[0].rename(other_ns)
        summary = api.quantize(
            tmp_path / "m.safetensors", tmp_path / "q.safetensors", QuantizeOptions(), device="cpu"
        )
        assert summary.stale_temps_removed == 1
        assert not stale.exists() and other_ns.exists()
    finally:
        live.kill()
        live.communicate()
    assert remove_stale_temps(tmp_path) == 1  # its process is gone: the lock went with it
    assert not other_ns.exists()


@pytest.mark.slow
def test_cleanup_by_another_run_never_breaks_a_commit(tmp_path: Path) -> None:
    from qtool.io.atomic import OutputSet

    with OutputSet() as outputs:
        outputs.create(tmp_path / "a.bin").write(b"a")
        outputs.create(tmp_path / "b.bin", last=True).write(b"b")
        code = (
            "import sys; from pathlib import Path; "
            "from qtool.io.atomic import remove_stale_temps as r; print(r(Path(sys.argv[1])))"
        )
        cleanup = [sys.executable, "-c", code, str(tmp_path)]
        assert subprocess.run(cleanup, capture_output=True, text=True).stdout == "0\n"
        outputs.commit()
    assert (tmp_path / "a.bin").read_bytes() == b"a" and (tmp_path / "b.bin").read_bytes() == b"b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.bin"]


def test_a_signal_between_creating_and_locking_a_temp_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qtool.io import atomic

    def interrupted(fd: int, temp: Path) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "_lock_own_temp", interrupted)
    with pytest.raises(KeyboardInterrupt), atomic.OutputSet() as outputs:
        outputs.create(tmp_path / "a.bin")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_where_locks_are_not_enforced_only_old_temps_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qtool.io import atomic

    monkeypatch.setattr(atomic, "_locks_enforced", lambda directory: False)
    # a commit's second name of the file it replaces, linked a moment ago: its mtime is the old
    # file's (3 days), its ctime the link's: not stale
    aside = tmp_path / f".q.qparams.safetensors.qtool-old-{_dead_pid()}-00000003"
    aside.write_bytes(b"x")
    days_ago = time.time() - 3 * 86400
    os.utime(aside, (days_ago, days_ago))
    assert remove_stale_temps(tmp_path) == 0 and aside.exists()
    aside.unlink()
    # no test can age a ctime: the clock moves a day on instead; `young` is written then
    young = tmp_path / f".q.safetensors.qtool-tmp-{_dead_pid()}-00000001"
    old = tmp_path / f".q.safetensors.qtool-tmp-{_dead_pid()}-00000002"
    for p in (young, old):
        p.write_bytes(b"x")
    later = time.time() + atomic.STALE_AGE_S + 60
    os.utime(young, (later, later))
    monkeypatch.setattr(time, "time", lambda: later)
    assert remove_stale_temps(tmp_path) == 1
    assert young.exists() and not old.exists()


def test_lock_probe_sees_enforced_locks_here(tmp_path: Path) -> None:
    from qtool.io.atomic import _locks_enforced

    assert _locks_enforced(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


@pytest.mark.slow
def test_plot_outputs_say_what_was_written(samples: Path) -> None:
    pytest.importorskip("matplotlib")
    m, q, png = samples / "mlp.safetensors", samples / "q.safetensors", samples / "r.png"
    result = CliRunner().invoke(
        app, ["quantize", str(m), "-o", str(q), "--plot", str(png), "--json"]
    )
    assert result.exit_code == 0, result.stderr
    __import__("json").loads(result.stdout)  # stdout stays one JSON document
    assert result.stderr == f"qtool: wrote {png}\n"
    result = CliRunner().invoke(app, ["compare", str(m), str(q), "--plot", str(png)])
    assert result.exit_code == 1 and "pass --force" in result.stderr
    result = CliRunner().invoke(app, ["compare", str(m), str(q), "--plot", str(png), "--force"])
    assert result.exit_code == 0 and result.stderr == f"qtool: wrote {png}\n"


@pytest.mark.parametrize("fallback", [False, True])
def test_output_that_appears_during_the_export_is_not_replaced(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback: bool
) -> None:
    """Another process creates -o between the preflight and the final rename (the hook runs
    at that exact moment); with or without renameat2."""
    monkeypatch.setattr(renames, "FORCE_FALLBACK", fallback)
    out = tmp_path / "out"
    real = renames.rename_noreplace

    def racing(dir_fd: int, old: str, new: str) -> None:
        out.mkdir()
        (out / "theirs.txt").write_text("another run")
        real(dir_fd, old, new)

    monkeypatch.setattr(renames, "rename_noreplace", racing)
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(out))
    assert code == 1 and "appeared while this run was writing" in err, err
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and leftovers(tmp_path) == []


def test_a_file_that_appears_in_the_old_export_during_force_is_kept(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    assert invoke("quantize", str(model), *CT, "-o", str(out))[0] == 0
    real = renames.exchange

    def racing(dir_fd: int, a: str, b: str) -> bool:
        if not (out / "late.txt").exists():
            (out / "late.txt").write_text("written meanwhile")
        return real(dir_fd, a, b)

    monkeypatch.setattr(renames, "exchange", racing)
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(out), "--force")
    assert code == 1 and "late.txt would be lost" in err, err
    assert (out / "late.txt").read_text() == "written meanwhile"
    assert (out / "model.safetensors").exists() and leftovers(tmp_path) == []


def test_force_replaces_a_previous_export_with_the_fallback_too(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    assert invoke("quantize", str(model), *CT, "-o", str(out))[0] == 0
    monkeypatch.setattr(renames, "FORCE_FALLBACK", True)
    code, _, err = invoke("quantize", str(model), *CT, "--dtype", "int4", "-o", str(out), "--force")
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    assert leftovers(tmp_path) == []


@pytest.mark.slow
def test_two_processes_exporting_to_the_same_new_directory(model: Path, tmp_path: Path) -> None:
    """Real processes: exactly one wins; the other fails clearly and leaves nothing."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "qtool", "quantize", str(model), *CT, "-o", str(out)]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [(p.returncode, p.communicate(timeout=300)[1]) for p in procs]
    results = [(p.returncode, err) for p, (_, err) in zip(procs, results, strict=True)]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    loser = next(err for code, err in results if code == 1)
    assert "appeared while this run was writing" in loser or "already exists" in loser, loser
    assert leftovers(tmp_path) == [] and (out / "model.safetensors").exists()


def test_cleanup_takes_only_dead_runs_dirs_and_restores_an_old_export(tmp_path: Path) -> None:
    live = tmp_path / ".x.qtool-tmp-1-00aa"
    live.mkdir()
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX)  # a live run's temp dir
    dead = tmp_path / ".x.qtool-tmp-2-00bb"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"partial")
    old = tmp_path / ".y.qtool-old-3-00cc"  # a dead run moved the export `y` aside
    old.mkdir()
    (old / "config.json").write_text("{}")
    try:
        assert outdir.remove_stale_dirs(tmp_path) == 2
        assert live.exists() and not dead.exists() and not old.exists()
        assert (tmp_path / "y" / "config.json").read_text() == "{}"
    finally:
        os.close(fd)


def test_disk_full_while_copying_a_companion_names_the_output(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"

    def full(src: object, dst: object, length: int = 0) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfileobj", full)
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(out))
    assert code == 1 and "no space left on device" in err, err
    assert str(out) in err and "qtool-tmp" not in err, err
    assert not out.exists() and leftovers(tmp_path) == []


def test_free_space_check_counts_the_companions(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (model / "tokenizer.json").write_bytes(b"x" * 5_000_000)
    weights = (model / "model.safetensors").stat().st_size
    usage = shutil.disk_usage(tmp_path)
    fake = type(usage)(usage.total, usage.used, weights + 1_000_000)  # data fits, tokenizer not
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: fake)
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(tmp_path / "out"))
    assert code == 1 and "free" in err and str(tmp_path / "out") in err, err
    assert "qtool-tmp" not in err and leftovers(tmp_path) == []


def _dead_temp_dir(parent: Path, name: str = "x", *, age_s: float = 0) -> Path:
    d = parent / f".{name}.qtool-tmp-99999-00ab"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"partial")
    if age_s:
        past = time.time() - age_s
        for p in (d / "model.safetensors", d):
            os.utime(p, (past, past))
    return d


def test_where_flock_does_nothing_only_old_temp_dirs_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some NFS and FUSE mounts accept flock and enforce nothing: a live run's fresh temp
    directory must survive another run's cleanup there; only day-old ones go."""
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: None)
    live = _dead_temp_dir(tmp_path, "live")  # fresh: as far as anyone can tell, alive
    old = _dead_temp_dir(tmp_path, "old", age_s=atomic.STALE_AGE_S + 3600)
    assert atomic.remove_stale_temps(tmp_path) == 1
    assert live.exists() and not old.exists()


def test_where_flock_does_nothing_an_export_beside_a_live_one_keeps_it(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: None)
    live = _dead_temp_dir(tmp_path, "busy")
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(tmp_path / "out"))
    assert code == 0, err
    assert (live / "model.safetensors").read_bytes() == b"partial"


def test_where_flock_fails_on_directories_the_export_still_runs(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some filesystems refuse flock on a directory (EBADF, ENOLCK): the export goes on,
    unlocked, and cleanup there falls back to the age rule."""
    real = fcntl.flock

    def no_dir_locks(fd: int, op: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOLCK, "No locks available")
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", no_dir_locks)
    fresh = _dead_temp_dir(tmp_path, "fresh")
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(tmp_path / "out"))
    assert code == 0, err
    assert fresh.exists() and (tmp_path / "out" / "config.json").exists()
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(tmp_path / "out"), "--force")
    assert code == 0, err


@pytest.mark.parametrize("command", ["quantize", "quantize-sharded", "dequantize", "plot"])
def test_every_command_writing_into_a_directory_removes_dead_temp_dirs(
    tmp_path: Path, command: str
) -> None:
    work = tmp_path / "w"
    work.mkdir()
    shutil.copy(SAMPLES / "mlp.safetensors", work / "mlp.safetensors")
    if command == "quantize-sharded":
        shutil.copytree(SAMPLES / "sharded-mlp", work / "sh")
        dead = _dead_temp_dir(work)  # a directory output is built beside -o: dead runs' go
        args = ["quantize", str(work / "sh"), "-o", str(work / "out")]
    elif command == "dequantize":
        assert invoke("quantize", str(work / "mlp.safetensors"))[0] == 0
        dead = _dead_temp_dir(work)
        args = ["dequantize", str(work / "mlp.int8.safetensors")]
    elif command == "plot":
        dead = _dead_temp_dir(work)
        args = [
            "plot",
            str(work / "mlp.safetensors"),
            "-t",
            "head.weight",
            "-o",
            str(work / "p.png"),
        ]
    else:
        dead = _dead_temp_dir(work)
        args = ["quantize", str(work / "mlp.safetensors")]
    code, _, err = invoke(*args)
    assert code == 0, err
    assert not dead.exists()


@pytest.mark.parametrize(
    ("step", "code", "said"),
    [("exchange", errno.EBUSY, "busy"), ("aside", errno.EBUSY, "busy"),
     ("into-place", errno.EBUSY, "busy"), ("exchange", errno.EACCES, "permission denied"),
     ("aside", errno.EACCES, "permission denied")],
)  # fmt: skip
def test_an_os_error_of_the_final_swap_names_the_output(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str, code: int, said: str
) -> None:
    out = tmp_path / "out"
    assert invoke("quantize", str(model), *CT, "-o", str(out))[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    busy = OSError(code, os.strerror(code))
    if step == "exchange":

        def exchange(dir_fd: int, a: str, b: str) -> bool:
            raise busy

        monkeypatch.setattr(renames, "exchange", exchange)
    else:
        monkeypatch.setattr(renames, "FORCE_FALLBACK", True)
        real_rename = os.rename

        def rename(src: str, dst: str, **kw: object) -> None:
            if (step == "aside" and ".qtool-old-" in str(dst)) or (
                step == "into-place" and ".qtool-tmp-" in str(src) and dst == "out"
            ):
                raise busy
            real_rename(src, dst, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "rename", rename)
    rc, _, err = invoke("quantize", str(model), *CT, "--dtype", "int4", "-o", str(out),
                        "--force")  # fmt: skip
    assert rc == 1 and "internal error" not in err and str(out) in err, err
    assert said in err.lower() and "qtool-tmp" not in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert leftovers(tmp_path) == []


def test_force_checks_the_directory_it_locked_is_still_the_output(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between opening -o and locking it, -o is swapped for a directory of someone else's
    files: the run must check (and refuse) that one, never swap it out to a temp name that the
    next cleanup would delete."""
    out = tmp_path / "out"
    assert invoke("quantize", str(model), *CT, "-o", str(out))[0] == 0
    real = fcntl.flock
    swapped = []

    def racing(fd: int, op: int) -> None:
        if op & fcntl.LOCK_EX and not swapped and os.readlink(f"/proc/self/fd/{fd}") == str(out):
            swapped.append(True)
            out.rename(tmp_path / "moved")
            out.mkdir()
            (out / "thesis.pdf").write_bytes(b"four years")
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", racing)
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(out), "--force")
    monkeypatch.setattr(fcntl, "flock", real)
    assert swapped and code == 1 and "thesis.pdf would be lost" in err, err
    atomic.remove_stale_temps(tmp_path)  # the next run's cleanup
    assert (out / "thesis.pdf").read_bytes() == b"four years"
    assert leftovers(tmp_path) == []


def test_an_output_parent_swapped_for_a_link_mid_export_publishes_nothing(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files are written by path: once -o's parent is swapped for a link to a directory where
    the temp name exists too, they land there. The export must not then publish an empty
    directory as `wrote`."""
    parent = tmp_path / "p"
    parent.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    real_create = atomic.OutputSet.create

    def create(self: atomic.OutputSet, final: Path, *, last: bool = False) -> object:
        if not (tmp_path / "moved").exists():
            parent.rename(tmp_path / "moved")
            parent.symlink_to(victim)
            (victim / final.parent.name).mkdir()
        return real_create(self, final, last=last)

    monkeypatch.setattr(atomic.OutputSet, "create", create)
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(parent / "out"))
    assert code == 1 and "was moved or replaced" in err, err
    assert not (tmp_path / "moved" / "out").exists() and leftovers(tmp_path / "moved") == []


@pytest.mark.parametrize("into", ["link", "nothing", "file"])
def test_an_output_swapped_while_it_is_checked_is_a_clear_error(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, into: str
) -> None:
    """-o is a directory when qtool looks, and a link, a file or gone when it opens it."""
    out = tmp_path / "out"
    assert invoke("quantize", str(model), *CT, "-o", str(out))[0] == 0
    victim = tmp_path / "victim"
    victim.mkdir()

    def swap(path: Path) -> bool:
        if path == out and out.is_dir() and not out.is_symlink():
            out.rename(tmp_path / "real")
            if into == "link":
                out.symlink_to(victim)
            elif into == "file":
                out.write_text("theirs")
        return False

    monkeypatch.setattr(outcheck, "is_mount_point", swap)
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(out), "--force")
    assert code == 1 and "changed while qtool checked it" in err and "internal" not in err, err
    assert list(victim.iterdir()) == [] and leftovers(tmp_path) == []


def test_force_behind_a_lock_held_forever_is_an_error_not_a_hang(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process (a stopped qtool run, or anyone who can open it) holds -o's lock."""
    out = tmp_path / "out"
    assert invoke("quantize", str(model), *CT, "-o", str(out))[0] == 0
    monkeypatch.setattr(outdir, "LOCK_WAIT_S", 0.3)
    holder = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        code, _, err = invoke("quantize", str(model), *CT, "-o", str(out), "--force")
    finally:
        os.close(holder)
    assert code == 1 and "is locked by another process" in err, err
    assert (out / "config.json").exists() and leftovers(tmp_path) == []


def test_companions_with_names_that_are_not_utf8_are_exported_and_replaced(
    model: Path, tmp_path: Path
) -> None:
    """The manifest records them (as \\udcXX escapes); --force then recognises them."""
    (Path(os.fsdecode(bytes(model) + b"/\xff\xfe-notes.txt"))).write_bytes(b"hi")
    out = tmp_path / "out"
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(out))
    assert code == 0, err
    assert b"\xff\xfe-notes.txt" in os.listdir(os.fsencode(out))
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(out), "--force")
    assert code == 0, err
