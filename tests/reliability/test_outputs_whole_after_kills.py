"""Outputs appear whole or not at all when the run is killed: SIGKILL at every step of a
compressed-tensors export (named kill points and random moments), at random moments of a
single-file quantize, SIGINT/SIGTERM mid-write, and concurrent `--force` exports to one
directory. The invariant: once the next run has cleaned up, `-o` is missing (a fresh export),
the previous export or the new one, complete, byte for byte; nothing else is left.
`QTOOL_KILLS` sets the number of random kills (8 and 4 by default; 200 and 100 with
QTOOL_EXHAUSTIVE=1). Every test here spawns processes."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qtool.errors import SidecarError
from qtool.formats.qtool.manifest import sidecar_path
from qtool.formats.qtool.reader import QtoolReader
from qtool.io import atomic, outdir
from qtool.io.manifest import MANIFEST
from qtool.io.stformat import read_header
from tests.conftest import SAMPLES
from tests.conftest import run_qtool as invoke
from tests.outputs import CT, ERROR_LINE, EXHAUSTIVE, checkpoint, leftovers

pytestmark = pytest.mark.slow  # every test spawns and kills processes

# A child qtool that SIGKILLs itself at one point of the export (argv[1]), then runs argv[2:].
CHILD = r"""
import os, shutil, signal, sys
from qtool.io import outdir, renames, tempdirs

point = sys.argv[1]
def die():
    os.kill(os.getpid(), signal.SIGKILL)
def hook(module, name, when):
    real = getattr(module, name)
    def hooked(*args, **kwargs):
        if when(*args, before=True):
            die()
        result = real(*args, **kwargs)
        if when(*args, before=False):
            die()
        return result
    setattr(module, name, hooked)
if point.startswith("fallback-"):
    renames.FORCE_FALLBACK = True
    point = point[len("fallback-"):]
if point == "copying":  # a companion half copied into the temp directory
    def half(fin, fout, length=0):
        fout.write(fin.read(10))
        fout.flush()
        die()
    shutil.copyfileobj = half
elif point == "manifest":
    hook(outdir, "write_manifest", lambda *a, before: not before)
elif point == "created":
    hook(renames, "rename_noreplace", lambda fd, old, new, before: not before)
elif point == "exchanged":
    hook(renames, "exchange", lambda fd, a, b, before: not before)
elif point == "aside":
    real_rename = os.rename
    def rename(src, dst, **kw):
        real_rename(src, dst, **kw)
        if ".qtool-old-" in str(dst):
            die()
    os.rename = rename
elif point == "placed":
    hook(renames, "rename_noreplace", lambda fd, old, new, before: not before)
elif point == "removing":  # one file of the old export gone, then killed
    def rmtree_at(fd, name):
        inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.unlink("config.json", dir_fd=inner)
        die()
    tempdirs.rmtree_at = rmtree_at
from qtool.cli import main
sys.argv = ["qtool", *sys.argv[2:]]
main()
"""


def _run(args: list[str], point: str | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-c", CHILD, point or "none", *args] if point else [
        sys.executable, "-m", "qtool", *args]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _export(src: Path, out: Path, *extra: str) -> None:
    proc = _run(["quantize", str(src), *CT, "-o", str(out), *extra])
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err.decode()


def _content(directory: Path) -> dict[str, bytes]:
    """What an export holds, the manifest aside (it records inodes and mtimes)."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name != MANIFEST}


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".qtool-" in p.name]


def _settle(parent: Path, out: Path, allowed: dict[str, dict[str, bytes] | None]) -> str:
    """The next run's cleanup, then the invariant: `out` is one of `allowed` (None: missing),
    complete and true to its manifest, and nothing else is left. Returns which one."""
    atomic.remove_stale_temps(parent)
    assert _leftovers(parent) == [], _leftovers(parent)
    if not out.exists():
        assert None in allowed.values(), "the previous export was lost"
        return "missing"
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        outdir.refuse_unknown_files(out, fd, [])  # a complete export, its manifest true
    finally:
        os.close(fd)
    content = _content(out)
    found = [state for state, expected in allowed.items() if expected == content]
    assert found, f"{out} holds neither export: {sorted(content)}"
    return found[0]


@pytest.fixture(scope="module")
def exports(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict[str, bytes], dict[str, bytes]]:
    """The model, and what its int8 and int4 exports hold (both deterministic)."""
    base = tmp_path_factory.mktemp("kills")
    src = base / "m"
    shutil.copytree(SAMPLES / "tiny-llama", src)
    (src / "tokenizer.json").write_bytes(os.urandom(300_000))
    _export(src, base / "int8")
    _export(src, base / "int4", "--dtype", "int4")
    _export(src, base / "int4-again", "--dtype", "int4")
    assert _content(base / "int4") == _content(base / "int4-again")
    return src, _content(base / "int8"), _content(base / "int4")


FRESH = ["copying", "manifest", "created"]

FORCE = ["copying", "manifest", "exchanged", "removing",
         "fallback-aside", "fallback-placed", "fallback-removing"]  # fmt: skip


@pytest.mark.parametrize(("point", "force"), [*((p, False) for p in FRESH),
                                              *((p, True) for p in FORCE)])  # fmt: skip
def test_sigkill_at_each_step_of_an_export_loses_nothing(
    exports: tuple[Path, dict[str, bytes], dict[str, bytes]],
    tmp_path: Path,
    point: str,
    force: bool,
) -> None:
    src, old, new = exports
    out = tmp_path / "out"
    if force:  # the previous export (its files are all hashed whole: a copy is as good)
        shutil.copytree(src.parent / "int8", out)
    args = ["quantize", str(src), *CT, "--dtype", "int4", "-o", str(out)]
    proc = _run([*args, "--force"] if force else args, point)
    proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, f"{point} was never reached"
    allowed = {"previous": old, "new": new} if force else {"missing": None, "new": new}
    state = _settle(tmp_path, out, allowed)
    if point in ("exchanged", "removing", "fallback-placed", "fallback-removing", "created"):
        assert state == "new", state
    else:
        assert state == ("previous" if force else "missing"), state


def _big(directory: Path) -> None:
    directory.mkdir()
    config = json.loads((SAMPLES / "tiny-llama" / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 8}))
    (directory / "tokenizer.json").write_bytes(os.urandom(2_000_000))
    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(1024, 1024)
               for i in range(8)}, directory / "model.safetensors")  # fmt: skip


def test_sigkill_at_random_moments_of_exports_loses_nothing(tmp_path: Path) -> None:
    kills = int(os.environ.get("QTOOL_KILLS", 100 if EXHAUSTIVE else 4))
    src = tmp_path / "big"
    _big(src)
    out = tmp_path / "out"
    # The window: from the temp directory's appearance to the export's.
    proc = _run(["quantize", str(src), *CT, "-o", str(out)])
    while not _leftovers(tmp_path) and proc.poll() is None:
        time.sleep(0.002)
    started = time.monotonic()
    while not out.exists() and proc.poll() is None:
        time.sleep(0.002)
    window = time.monotonic() - started
    proc.communicate(timeout=600)
    previous = _content(out)
    rng = random.Random(17)
    states: dict[str, int] = {}
    for i in range(kills):
        force = i % 2 == 0
        if not force:
            shutil.rmtree(out, ignore_errors=True)
        if force and not out.exists():
            _export(src, out)
        args = ["quantize", str(src), *CT, "-o", str(out), *(["--force"] if force else [])]
        proc = _run(args)
        while not _leftovers(tmp_path) and proc.poll() is None:
            time.sleep(0.002)
        time.sleep(rng.uniform(0, window * 1.3))
        proc.kill()
        proc.communicate()
        # the same options write the same bytes: the previous and the new export are alike
        allowed = {"complete": previous} if force else {"missing": None, "complete": previous}
        state = _settle(tmp_path, out, allowed)
        states[state] = states.get(state, 0) + 1
    _export(SAMPLES / "tiny-llama", tmp_path / "next")  # a real next run beside them: clean
    assert _leftovers(tmp_path) == []
    print(f"kills: {kills}, states: {states}")


def test_two_concurrent_force_exports_to_one_directory(
    exports: tuple[Path, dict[str, bytes], dict[str, bytes]], tmp_path: Path
) -> None:
    src, old, new = exports
    out = tmp_path / "out"
    for _ in range(3):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(src.parent / "int8", out)
        procs = [_run(["quantize", str(src), *CT, "--dtype", dtype, "-o", str(out), "--force"])
                 for dtype in ("int8", "int4")]  # fmt: skip
        results = [(p.communicate(timeout=600)[1].decode(), p.returncode) for p in procs]
        for err, code in results:
            assert code == 0 or ("appeared" in err or "changed while" in err), err
            assert "internal error" not in err and "Traceback" not in err, err
        assert any(code == 0 for _, code in results), results
        assert _settle(tmp_path, out, {"int8": old, "int4": new})
        assert _leftovers(tmp_path) == []


def _default_sigint() -> None:
    # A shell starts background jobs with SIGINT ignored, and Python keeps it ignored (as a
    # well-behaved tool should); restore the default so that the run reacts like one at a prompt.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spawn(args: list[str], capture: bool = True) -> subprocess.Popen[bytes]:
    stream = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen(
        [sys.executable, "-m", "qtool", *args],
        stdout=stream,
        stderr=stream,
        preexec_fn=_default_sigint,
    )


def _wait_for_temp(directory: Path, proc: subprocess.Popen[bytes], timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(".qtool-tmp-" in p.name for p in directory.iterdir()):
            return True
        time.sleep(0.002)
    return False


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_mid_write_cleans_up(tmp_path: Path, sig: signal.Signals, code: int) -> None:
    # 384 MiB: a write window of a second or more, so the signal lands inside it.
    checkpoint(tmp_path / "m.safetensors", tensors=96, rows=2048, cols=512)
    out = tmp_path / "q.safetensors"
    seen = []
    for _attempt in range(5):  # the signal must land while outputs are being written
        proc = _spawn(["quantize", str(tmp_path / "m.safetensors"), "-o", str(out)])
        seen.append(_wait_for_temp(tmp_path, proc))
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
        if proc.returncode != 0:
            break
        for p in (out, sidecar_path(out)):
            p.unlink(missing_ok=True)
    else:
        pytest.skip(f"every run finished before the signal arrived (temp seen: {seen})")
    assert proc.returncode == code
    assert stdout == b""
    assert ERROR_LINE.match(stderr.decode()), stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def _check_final_names(directory: Path, out: Path, previous: bytes | None) -> str:
    """The kill invariant; returns which state the outputs are in."""
    side = sidecar_path(out)
    if not out.exists():
        # The quantized file appears last, so it can only be missing with its sidecar either
        # absent or already complete (a kill between the two renames).
        if side.exists():
            read_header(side)
            return "sidecar only"
        return "nothing"
    read_header(out)  # the quantized file is never partial
    try:
        QtoolReader(out).close()
        return "pair"
    except SidecarError as err:
        # Only an old quantized file beside a new sidecar, between the renames of a --force run.
        assert previous is not None and out.read_bytes() == previous, err
        assert "does not belong" in str(err)
        return "old file, new sidecar (refused)"


def test_sigkill_at_random_moments_never_leaves_a_bad_output(tmp_path: Path) -> None:
    kills = int(os.environ.get("QTOOL_KILLS", 200 if EXHAUSTIVE else 8))
    src = tmp_path / "m.safetensors"
    checkpoint(src, tensors=48, rows=2048)
    out = tmp_path / "q.safetensors"
    # Measure the window in which outputs are written: from the first temp file to the commit.
    proc = _spawn(["quantize", str(src), "-o", str(out)], capture=False)
    assert _wait_for_temp(tmp_path, proc)
    started = time.monotonic()
    while not out.exists() and proc.poll() is None:
        time.sleep(0.001)
    window = time.monotonic() - started
    assert proc.wait() == 0
    rng = random.Random(1234)
    states: dict[str, int] = {}
    landed = 0
    for i in range(kills):
        force = i % 2 == 1
        if force and not out.exists():  # a --force run over an existing pair
            subprocess.run([sys.executable, "-m", "qtool", "quantize", str(src), "-o", str(out),
                            "--force"], check=True, capture_output=True)  # fmt: skip
        previous = out.read_bytes() if force else None
        if not force:
            for p in (out, sidecar_path(out)):
                p.unlink(missing_ok=True)
        args = ["quantize", str(src), "-o", str(out), "--scheme", rng.choice(["sym", "asym"])]
        proc = _spawn([*args, "--force"] if force else args, capture=False)
        _wait_for_temp(tmp_path, proc)
        time.sleep(rng.uniform(0, window * 1.3))
        proc.kill()
        proc.wait()
        state = _check_final_names(tmp_path, out, previous)
        states[state] = states.get(state, 0) + 1
        # A SIGKILL cannot clean up: a temp file of this pid proves it landed mid-write.
        landed += any(f".qtool-tmp-{proc.pid}-" in p.name for p in tmp_path.iterdir())
    # Kills that all missed the write window would prove nothing about it.
    assert landed > 0, f"no kill of {kills} landed while outputs were written: {states}"
    # A clean run afterwards removes every temp file the kills left behind.
    subprocess.run([sys.executable, "-m", "qtool", "quantize", str(src), "-o", str(out), "--force"],
                   check=True, capture_output=True)  # fmt: skip
    assert not [p for p in tmp_path.iterdir() if ".qtool-tmp-" in p.name]
    print(f"kills survived: {kills}, landed mid-write: {landed}, states: {states}")


def _big_model(directory: Path) -> None:
    directory.mkdir()
    config = json.loads((SAMPLES / "tiny-llama" / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 24}))
    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(1024, 1024)
               for i in range(24)}, directory / "model.safetensors")  # fmt: skip


def test_a_killed_export_leaves_a_temp_dir_the_next_run_removes(tmp_path: Path) -> None:
    _big_model(tmp_path / "big")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "qtool", "quantize", str(tmp_path / "big"), *CT, "-o", str(out)]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not leftovers(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = leftovers(tmp_path)
    assert left and not out.exists(), "the export finished before it could be killed"
    assert invoke("quantize", str(SAMPLES / "tiny-llama"), *CT, "-o", str(tmp_path / "o2"))[0] == 0
    assert leftovers(tmp_path) == []
