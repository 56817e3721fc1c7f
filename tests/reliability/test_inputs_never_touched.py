"""Inputs are never touched and outputs never land on inputs: `-o` that is, contains or lies
inside an input (by any spelling: links, hard links, `.`), a special file or a mount point as
`-o`, and `--force` replacing only an export qtool wrote and nobody changed since (a manifest
naming each file; large files fingerprinted). Each is refused before any work, in one line,
with every input byte for byte as it was."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from typer.testing import CliRunner

from qtool import api
from qtool.cli import app
from qtool.engine.plan import QuantizeOptions
from qtool.errors import OutputError
from qtool.io import manifest
from qtool.io.mounts import mount_points
from tests.conftest import SAMPLES
from tests.conftest import run_qtool as invoke
from tests.outputs import CT, EXHAUSTIVE, checkpoint, leftovers, snapshot


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


def test_preflight_refuses_before_reading(tmp_path: Path) -> None:
    checkpoint(tmp_path / "m.safetensors")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "access", lambda path, mode: not mode & os.W_OK)
        with pytest.raises(OutputError, match="not writable"):
            api.quantize(
                tmp_path / "m.safetensors", tmp_path / "q.safetensors", QuantizeOptions(),
                device="cpu",
            )  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        import shutil

        mp.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 10))  # type: ignore[attr-defined]
        with pytest.raises(OutputError, match="has 10 free"):
            api.quantize(
                tmp_path / "m.safetensors", tmp_path / "q.safetensors", QuantizeOptions(),
                device="cpu",
            )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


# Names in a scratch directory: the input and its sidecar, other spellings of them, special
# files, and names that do not exist yet.
_SPELLINGS = ["m", "./m", "dir-link/m", "hard", "sym", "side", "side-hard", "fifo", "sym-fifo",
              "plain", "new1", "new2", "dangling", "sub/new"]  # fmt: skip


def _layout(d: Path) -> None:
    (d / "m").write_bytes(b"input")
    (d / "m.qparams.safetensors").write_bytes(b"sidecar")
    (d / "plain").write_bytes(b"an old output")
    os.link(d / "m", d / "hard")
    os.link(d / "m.qparams.safetensors", d / "side-hard")
    (d / "sym").symlink_to(d / "m")
    (d / "side").symlink_to(d / "m.qparams.safetensors")
    (d / "dir-link").symlink_to(d)
    (d / "dangling").symlink_to(d / "nowhere")
    os.mkfifo(d / "fifo")
    (d / "sym-fifo").symlink_to(d / "fifo")


@settings(max_examples=300 if not EXHAUSTIVE else 5_000, deadline=None,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(
    names=st.lists(st.sampled_from(_SPELLINGS), min_size=1, max_size=4),
    force=st.booleans(),
)
def test_fuzz_preflight_then_write_never_loses_anything(
    tmp_path_factory: pytest.TempPathFactory, names: list[str], force: bool
) -> None:
    """Whatever outputs a run names: if the preflight passes, writing them all replaces no
    input, sidecar or special file, and no two outputs land on one file."""
    from qtool.io.atomic import OutputSet, preflight

    d = tmp_path_factory.mktemp("pre")
    _layout(d)
    outputs = [d / n for n in names]
    try:
        preflight(outputs, [d / "m", d / "m.qparams.safetensors"], force=force)
    except OutputError:
        return
    with OutputSet() as out:
        for i, path in enumerate(outputs):
            out.create(path).write(b"output %d" % i)
        out.commit()
    assert (d / "m").read_bytes() == b"input"
    assert (d / "m.qparams.safetensors").read_bytes() == b"sidecar"
    assert stat.S_ISFIFO(os.lstat(d / "fifo").st_mode)
    assert len({os.stat(p).st_ino for p in outputs}) == len(outputs)
    assert force or not {"plain", "dangling"} & set(names)


def _special_node(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        os.mknod(path, stat.S_IFSOCK | 0o600)
    elif kind == "char-device":  # a private copy of /dev/null (needs root)
        if os.geteuid() != 0:
            pytest.skip("creating a device node needs root")
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["fifo", "socket", "char-device"])
@pytest.mark.parametrize(
    "command", ["quantize", "quantize-plot", "dequantize", "compare-plot", "plot", "sharded"]
)
def test_no_command_replaces_a_special_file_even_with_force(
    tmp_path: Path, kind: str, command: str
) -> None:
    m = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(8, 4)}, m)
    q = tmp_path / "q.safetensors"
    api.quantize(m, q, QuantizeOptions(), device="cpu")
    # Named as the command's outputs are (a wrong extension is a usage error before this check).
    node = tmp_path / ("node.png" if command.endswith("plot") else "node.safetensors")
    if command == "sharded":
        (tmp_path / "model").mkdir()
        save_file({"w": torch.randn(8, 4)}, tmp_path / "model/a.safetensors")
        (tmp_path / "model/x.safetensors.index.json").write_text(
            '{"weight_map": {"w": "a.safetensors"}}'
        )
        (tmp_path / "o").mkdir()
        node = tmp_path / "o" / "a.safetensors"
    _special_node(node, kind)
    args = {
        "quantize": ["quantize", str(m), "-o", str(node)],
        "quantize-plot": [
            "quantize",
            str(m),
            "-o",
            str(tmp_path / "q2.safetensors"),
            "--plot",
            str(node),
        ],
        "dequantize": ["dequantize", str(q), "-o", str(node)],
        "compare-plot": ["compare", str(m), str(q), "--plot", str(node)],
        "plot": ["plot", str(m), "-t", "w", "-o", str(node)],
        "sharded": ["quantize", str(tmp_path / "model"), "-o", str(tmp_path / "o")],
    }[command]
    before = os.lstat(node)
    result = CliRunner().invoke(app, [*args, "--force"])
    assert result.exit_code == 1, result.stderr
    if command == "sharded":  # a directory output replaces only a previous qtool export
        assert "is not a qtool export (a.safetensors would be lost)" in result.stderr
    else:
        assert "not a regular file; qtool replaces only regular files" in result.stderr
    after = os.lstat(node)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert not (tmp_path / "q2.safetensors").exists()
    assert not [p for p in tmp_path.rglob("*") if ".qtool-tmp-" in p.name]


def test_commit_refuses_a_special_file_that_appeared_after_the_preflight(tmp_path: Path) -> None:
    from qtool.io.atomic import OutputSet

    with pytest.raises(OutputError, match="is a FIFO"), OutputSet() as outputs:
        outputs.create(tmp_path / "a.bin").write(b"a")
        os.mkfifo(tmp_path / "a.bin")
        outputs.commit()
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]
    assert stat.S_ISFIFO(os.lstat(tmp_path / "a.bin").st_mode)


def _overwrite_in_place(path: Path, *, keep_mtime: bool) -> bytes:
    """What another tool does: the same number of bytes written over the file (same inode)."""
    st = path.stat()
    data = os.urandom(st.st_size)
    with path.open("r+b") as f:
        f.write(data)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return data


def test_a_same_size_overwrite_of_a_large_exported_file_is_kept(tmp_path: Path) -> None:
    """The audit's reproduction, at its real size: a weights file over the hashed limit."""
    src = tmp_path / "big"
    src.mkdir()
    config = json.loads((SAMPLES / "tiny-llama" / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 17}))
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
