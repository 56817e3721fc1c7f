"""Issue 17, "Nothing lost, round 3": model directories, output-directory transactions, races,
kills and full disks on the compressed-tensors paths. Each test is the issue's reproduction (or
a harder sibling) and failed before the fix."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qtool.io import outdir, renames
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


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# ---- 1. --force never deletes what qtool did not write; never an input ----------------------


def test_force_refuses_a_directory_holding_files_qtool_did_not_write(
    model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert invoke("quantize", str(model), *CT, "-o", str(out))[0] == 0
    (out / "thesis.pdf").write_bytes(b"four years")
    (out / "sub").mkdir()
    (out / "sub" / "notes.txt").write_text("more")
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(out), "--force")
    assert code == 1 and "sub/, thesis.pdf would be lost" in err, err
    assert (out / "thesis.pdf").read_bytes() == b"four years"
    assert (out / "sub" / "notes.txt").exists() and leftovers(tmp_path) == []


def test_force_refuses_an_export_whose_files_were_edited(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert invoke("quantize", str(model), *CT, "-o", str(out))[0] == 0
    (out / "generation_config.json").write_text('{"edited": true}')
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(out), "--force")
    assert code == 1 and "generation_config.json would be lost" in err, err
    assert (out / "generation_config.json").read_text() == '{"edited": true}'


def test_force_refuses_a_directory_without_a_manifest_naming_three(
    model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for name in ("a.txt", "b.txt", "c.txt", "d.txt", "e.txt"):
        (out / name).write_text(name)
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(out), "--force")
    assert code == 1 and "a.txt, b.txt, c.txt and 2 more would be lost" in err, err
    assert "is not a qtool export" in err and len(list(out.iterdir())) == 5


@pytest.mark.parametrize("where", ["parent", "inside", "config-parent", "grandparent"])
def test_output_that_contains_or_lies_inside_an_input_is_refused(
    model: Path, tmp_path: Path, where: str
) -> None:
    config = tmp_path / "cfgs" / "config.json"
    config.parent.mkdir()
    shutil.copy(model / "config.json", config)
    (tmp_path / "alias").symlink_to(tmp_path)
    args = [str(model)]
    out = {
        "parent": tmp_path / "alias",  # through a symlink: compared by device and inode
        "inside": model / "sub",
        "config-parent": config.parent,
        "grandparent": tmp_path.parent / tmp_path.name,
    }[where]
    if where == "config-parent":
        args = [str(model / "model.safetensors"), "--config", str(config)]
    before = snapshot(tmp_path)
    code, _, err = invoke("quantize", *args, *CT, "-o", str(out), "--force")
    assert code == 1, err
    assert ("contains the input" in err) or ("lies inside the input" in err), err
    assert snapshot(tmp_path) == before


# ---- 2. races: an output that appears meanwhile is never replaced ---------------------------


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


# ---- 3./4. reading a model directory: one descriptor, no links out, bounded configs ---------


def test_a_companion_swapped_for_a_link_after_the_check_is_never_copied(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qtool.io.safeopen import InputDir

    secret = tmp_path / "secret.txt"
    secret.write_text("API_KEY=hunter2")
    real = InputDir.problem

    def swapped(self: InputDir, name: str) -> str | None:
        why = real(self, name)
        if name == "generation_config.json":  # checked: now swap it, as the attacker did
            (self.path / name).unlink()
            (self.path / name).symlink_to(secret)
        return why

    monkeypatch.setattr(InputDir, "problem", swapped)
    out = tmp_path / "out"
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(out))
    # refused when the copy meets the link, or skipped when a later check sees it: never copied
    assert code == 1 or not (out / "generation_config.json").exists(), err
    assert leftovers(tmp_path) == []
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()]
    assert all(b"hunter2" not in p.read_bytes() for p in written if p != secret)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge", "deep", "link-out"])
def test_config_json_is_read_bounded_and_regular_only(
    model: Path, tmp_path: Path, kind: str
) -> None:
    config = model / "config.json"
    config.unlink()
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "dev-zero":
        config.symlink_to("/dev/zero")
    elif kind == "huge":
        config.write_text('{"a": "' + "x" * 17_000_000 + '"}')
    elif kind == "deep":
        config.write_text("[" * 200_000)
    else:
        (tmp_path / "other.json").write_text("{}")
        config.symlink_to(tmp_path / "other.json")
    started = time.monotonic()
    code, _, err = invoke("quantize", str(model), *CT, "-o", str(tmp_path / "out"))
    assert code == 1 and "config.json" in err and "Traceback" not in err, err
    assert "internal error" not in err and time.monotonic() - started < 60
    expect = {"fifo": "FIFO", "dev-zero": "symlink", "huge": "over", "deep": "nested more than",
              "link-out": "symlink"}[kind]  # fmt: skip
    assert expect in err, err
    # the reading side (a compressed-tensors directory) reads it the same way
    q = tmp_path / "q"
    assert invoke("quantize", str(SAMPLES / "tiny-llama"), *CT, "-o", str(q))[0] == 0
    (q / "config.json").unlink()
    shutil.copy(config, q / "config.json") if kind in ("huge", "deep") else os.mkfifo(
        q / "config.json")  # fmt: skip
    for command in ("inspect", "dequantize"):
        code, _, err = invoke(command, str(q))
        assert code == 1 and "internal error" not in err, err


# ---- 5. kills: the next run removes what a killed one left -------------------------------------


def _big_model(directory: Path) -> None:
    directory.mkdir()
    shutil.copy(SAMPLES / "tiny-llama" / "config.json", directory / "config.json")
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


# ---- 11./12./13. messages, full disks, links as -o ---------------------------------------------


@pytest.mark.parametrize("spelling", [".", "b/..", "link"])
def test_output_spellings_that_cannot_be_renamed_to_are_refused_before_work(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "b").mkdir()
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "mine.txt").write_text("mine")
    (tmp_path / "link").symlink_to("real")
    before = snapshot(tmp_path)
    code, _, err = invoke("quantize", str(model), *CT, "-o", spelling, "--force")
    assert code in (1, 2) and "internal error" not in err and "EBUSY" not in err, err
    assert snapshot(tmp_path) == before and leftovers(tmp_path) == []


def test_dequantize_dot_names_its_default_output(model: Path, tmp_path: Path) -> None:
    q = tmp_path / "q"
    assert invoke("quantize", str(model), *CT, "-o", str(q))[0] == 0
    cwd = os.getcwd()
    os.chdir(q)
    try:
        code, _, err = invoke("dequantize", ".")
    finally:
        os.chdir(cwd)
    assert code == 0, err
    assert (tmp_path / "q.dequantized" / "model.safetensors").exists()


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
