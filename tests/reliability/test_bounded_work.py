"""Issue 17, round 3 audit gaps: what an export's manifest records of large files, output
directories beside a single input file, temp directories where locks do nothing, the total
time of patterns from files, recipe patterns that crash the compiler, mount points as `-o`,
and errors of the final swap. Each test failed before its fix."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qtool import patterns
from qtool.io import atomic, manifest, outcheck, outdir, renames
from qtool.io.mounts import mount_points
from tests.conftest import SAMPLES
from tests.conftest import run_qtool as invoke

CT = ("--format", "compressed-tensors")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    dest = tmp_path / "m"
    shutil.copytree(SAMPLES / "tiny-llama", dest)
    return dest


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".qtool-tmp-" in p.name or ".qtool-old-" in p.name]


def _overwrite_in_place(path: Path, *, keep_mtime: bool) -> bytes:
    """What another tool does: the same number of bytes written over the file (same inode)."""
    st = path.stat()
    data = os.urandom(st.st_size)
    with path.open("r+b") as f:
        f.write(data)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return data


# ---- 1. --force judges large files by a fingerprint, not by their size ----------------------


def test_a_same_size_overwrite_of_a_large_exported_file_is_kept(tmp_path: Path) -> None:
    """The audit's reproduction, at its real size: a weights file over the hashed limit."""
    src = tmp_path / "big"
    src.mkdir()
    shutil.copy(SAMPLES / "tiny-llama" / "config.json", src / "config.json")
    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(1024, 1024)
               for i in range(17)}, src / "model.safetensors")  # fmt: skip
    out = tmp_path / "out"
    assert invoke("quantize", str(src), *CT, "-o", str(out))[0] == 0
    weights = out / "model.safetensors"
    assert weights.stat().st_size > manifest.HASHED_MAX_BYTES
    theirs = _overwrite_in_place(weights, keep_mtime=False)
    code, _, err = invoke("quantize", str(src), *CT, "-o", str(out), "--force")
    assert code == 1 and "model.safetensors would be lost" in err, err
    assert weights.read_bytes() == theirs and leftovers(tmp_path) == []


@pytest.mark.parametrize("how", ["in-place-same-mtime", "replaced-same-mtime", "touched"])
def test_force_fingerprints_files_over_the_hashed_limit(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """With the limit lowered, model.safetensors is a 'large' file: its size, inode, mtime and
    sampled blocks are recorded; another writer matching the size (and even the mtime) is
    caught."""
    monkeypatch.setattr(manifest, "HASHED_MAX_BYTES", 1024)
    out = tmp_path / "out"
    assert invoke("quantize", str(model), *CT, "-o", str(out))[0] == 0
    weights = out / "model.safetensors"
    record = json.loads((out / manifest.MANIFEST).read_text())["files"]["model.safetensors"]
    assert record["sha256"] is None and record["sampled"], record
    st = weights.stat()
    if how == "in-place-same-mtime":
        theirs = _overwrite_in_place(weights, keep_mtime=True)
    elif how == "replaced-same-mtime":  # a new file of the same size, mtime copied (cp -p)
        theirs = weights.read_bytes()
        other = tmp_path / "other"
        other.write_bytes(theirs)
        os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(other, weights)
    else:  # same bytes, touched: not the file qtool wrote any more, as far as it can tell
        theirs = weights.read_bytes()
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(out), "--force")
    assert code == 1 and "model.safetensors would be lost" in err, err
    assert weights.read_bytes() == theirs


def test_force_still_replaces_an_untouched_large_export(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manifest, "HASHED_MAX_BYTES", 1024)
    out = tmp_path / "out"
    assert invoke("quantize", str(model), *CT, "-o", str(out))[0] == 0
    code, _, err = invoke("quantize", str(model), *CT, "--dtype", "int4", "-o", str(out), "--force")
    assert code == 0, err
    assert leftovers(tmp_path) == []


# ---- 2. a directory output never lies inside an input file's directory ----------------------


@pytest.mark.parametrize("where", ["beside-weights", "deeper", "beside-config"])
def test_a_directory_output_inside_a_single_inputs_directory_is_refused(
    model: Path, tmp_path: Path, where: str
) -> None:
    """A single file with --config is its model directory spelled otherwise: an output
    directory inside the weights' directory is refused, as `-o m/sub` is for `m/`. The
    directory --config lies in is not the model's (qtool reads that one file from it): an
    output beside the config is fine, one containing it is not (see the nesting test)."""
    config = tmp_path / "cfgs" / "config.json"
    config.parent.mkdir()
    shutil.copy(model / "config.json", config)
    out = {"beside-weights": model / "out", "beside-config": config.parent / "out",
           "deeper": model / "a" / "b"}[where]  # fmt: skip
    out.parent.mkdir(exist_ok=True)
    args = [str(model / "model.safetensors"), "--config", str(config), *CT, "-o", str(out)]
    code, _, err = invoke("quantize", *args)
    if where == "beside-config":
        assert code == 0 and (out / "config.json").exists(), err
        return
    assert code == 1 and "lies inside the input directory" in err, err
    assert not out.exists() and leftovers(out.parent) == []
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(out))  # the same, as a dir
    assert code == 1 and "lies inside the input directory" in err, err


def test_a_file_output_beside_a_single_input_is_still_fine(model: Path) -> None:
    """qtool's own format writes beside its input by default: not a directory output."""
    code, _, err = invoke("quantize", str(model / "model.safetensors"))
    assert code == 0, err
    assert (model / "model.int8.safetensors").exists()


# ---- 3. temp directories of killed runs: locks probed, every command cleans them ------------


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


# ---- 4./5. patterns from files: a total bound, and recipes compiled the bounded way ----------


SLOW = "(.*)" * 6  # ~0.05 s per match on a module name: under the per-match limit


def test_many_slow_ignore_patterns_are_refused_within_a_total_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(patterns, "TOTAL_LIMIT_S", 0.3)
    out = tmp_path / "q"
    assert invoke("quantize", str(SAMPLES / "tiny-llama"), *CT, "-o", str(out))[0] == 0
    doc = json.loads((out / "config.json").read_text())
    doc["quantization_config"]["ignore"] += [f"re:{SLOW}X{i}" for i in range(31)]
    (out / "config.json").write_text(json.dumps(doc))
    code, _, err = invoke("inspect", str(out))
    assert code == 1 and "in total" in err and "config.json" in err, err
    assert SLOW in err and "internal error" not in err


def test_many_slow_recipe_patterns_are_refused_within_a_total_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(patterns, "TOTAL_LIMIT_S", 0.3)
    recipe = tmp_path / "r.toml"
    slow = "(.*)" * 5  # tensor names are longer than module names
    rules = "".join(f'[[rule]]\nmatch = "re:{slow}X{i}"\nkeep = "k"\n' for i in range(31))
    recipe.write_text(rules)
    args = ["quantize", str(SAMPLES / "tiny-llama"), *CT, "--recipe", str(recipe)]
    code, _, err = invoke(*args, "-o", str(tmp_path / "o"), "--dry-run")
    assert code != 0 and "in total" in err and str(recipe) in err and "line " in err, err
    assert "internal error" not in err


def test_the_budget_belongs_to_one_file_not_to_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each bounded block (one file's patterns) starts afresh; results are remembered."""
    monkeypatch.setattr(patterns, "TOTAL_LIMIT_S", 0.2)
    slow = SLOW + "Y"
    for _ in range(3):
        with patterns.bounded():
            assert not patterns.matches(slow, "model.layers.0.mlp.up_proj")
    with patterns.bounded():
        for i in range(50):
            assert patterns.matches(r".*\.mlp\..*", f"model.layers.{i}.mlp.up_proj")


@pytest.mark.parametrize("depth", [5000, 499])  # over the length cap; under it, too deep for re
def test_a_deeply_nested_recipe_pattern_is_a_recipe_error(tmp_path: Path, depth: int) -> None:
    recipe = tmp_path / "r.toml"
    pattern = "(" * depth + ")" * depth
    recipe.write_text(f'# deep\n[[rule]]\nmatch = "re:{pattern}"\nkeep = "k"\n')
    args = ["quantize", str(SAMPLES / "tiny-llama"), *CT, "--recipe", str(recipe)]
    code, _, err = invoke(*args, "-o", str(tmp_path / "o"), "--dry-run")
    assert code == 2 and "internal error" not in err and "RecursionError" not in err, err
    assert str(recipe) in err and "line 3" in err and "match" in err, err


# ---- 6. -o on a mount point; errors of the final swap -----------------------------------------


def _bind(source: Path, target: Path) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to bind-mount")
    done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mount --bind failed: {done.stderr.decode().strip()}")


def _unmount(target: Path) -> None:
    """Unmount `target`, and whatever is still mounted below its directory (a mount a failing
    run moved along with its directory)."""
    subprocess.run(["umount", str(target)], check=False, capture_output=True)
    below = str(target.parent) + "/"
    for point in sorted(mount_points(), reverse=True):
        if point.startswith(below):
            subprocess.run(["umount", point], check=False, capture_output=True)


@pytest.mark.parametrize("force", [False, True])
def test_a_mount_point_as_output_is_refused_before_any_work(
    model: Path, tmp_path: Path, force: bool
) -> None:
    backing = tmp_path / "backing"
    mnt = tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    if force:  # a previous export, on the mount
        assert invoke("quantize", str(model), *CT, "-o", str(tmp_path / "prev"))[0] == 0
        for p in (tmp_path / "prev").iterdir():
            shutil.copy2(p, backing / p.name)
    _bind(backing, mnt)
    try:
        before = sorted(p.name for p in mnt.iterdir())
        args = ["quantize", str(model), *CT, "-o", str(mnt), *(["--force"] if force else [])]
        code, _, err = invoke(*args)
        assert code == 1 and "mount point" in err and "internal error" not in err, err
        assert "Quantization report" not in err
        assert sorted(p.name for p in mnt.iterdir()) == before
        assert leftovers(tmp_path) == []
    finally:
        _unmount(mnt)


def test_a_mounted_file_as_output_is_refused_before_any_work(tmp_path: Path) -> None:
    shutil.copy(SAMPLES / "mlp.safetensors", tmp_path / "mlp.safetensors")
    target = tmp_path / "q.safetensors"
    target.write_bytes(b"mounted")
    other = tmp_path / "other"
    other.write_bytes(b"theirs")
    _bind(other, target)
    try:
        code, _, err = invoke("quantize", str(tmp_path / "mlp.safetensors"), "-o", str(target),
                              "--force")  # fmt: skip
        assert code == 1 and "mount point" in err and "internal error" not in err, err
        assert target.read_bytes() == b"theirs"
    finally:
        _unmount(target)


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


@pytest.mark.parametrize("kind", ["fifo", "deep", "dev-zero"])
def test_an_unreadable_config_of_a_ct_directory_is_named(tmp_path: Path, kind: str) -> None:
    """Reading a compressed-tensors directory whose config.json cannot be read: the error is
    the config's, naming it, not 'no index file in this directory'."""
    q = tmp_path / "q"
    assert invoke("quantize", str(SAMPLES / "tiny-llama"), *CT, "-o", str(q))[0] == 0
    config = q / "config.json"
    config.unlink()
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "deep":
        config.write_text('{"quantization_config": ' + "[" * 200_000)
    else:
        config.symlink_to("/dev/zero")
    original = str(SAMPLES / "tiny-llama" / "model.safetensors")
    for args in (["inspect", str(q)], ["dequantize", str(q)], ["compare", original, str(q)]):
        code, _, err = invoke(*args)
        assert code == 1 and str(config) in err and "index" not in err, (args, err)


def test_force_never_takes_a_file_mounted_over_one_of_its_files(
    model: Path, tmp_path: Path
) -> None:
    """A file bind-mounted over a listed one, with the very content qtool wrote: not ours."""
    out = tmp_path / "out"
    assert invoke("quantize", str(model), *CT, "-o", str(out))[0] == 0
    theirs = tmp_path / "theirs.json"
    shutil.copy(out / "generation_config.json", theirs)
    _bind(theirs, out / "generation_config.json")
    try:
        code, _, err = invoke("quantize", str(model), *CT, "-o", str(out), "--force")
        assert code == 1 and "generation_config.json would be lost" in err, err
        assert leftovers(tmp_path) == []
    finally:
        _unmount(tmp_path / "x")
    assert theirs.exists()


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


def test_compiling_thousands_of_patterns_counts_against_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More distinct long patterns than the compile cache holds, recompiled for every module:
    compiling is bounded like matching."""
    monkeypatch.setattr(patterns, "TOTAL_LIMIT_S", 0.5)
    out = tmp_path / "q"
    assert invoke("quantize", str(SAMPLES / "tiny-llama"), *CT, "-o", str(out))[0] == 0
    doc = json.loads((out / "config.json").read_text())
    doc["quantization_config"]["ignore"] += [
        "re:" + "(a|b)" * 150 + f"x{i:05d}" for i in range(5000)
    ]
    (out / "config.json").write_text(json.dumps(doc))
    code, _, err = invoke("inspect", str(out))
    assert code == 1 and "in total to compile and match" in err and "config.json" in err, err
