"""Bad inputs and faults: every one answered with one clear line, nothing lost, nothing left."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import signal
import stat
import subprocess
import sys
import time
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
from qtool.errors import OutputError, QtoolError, SidecarError
from qtool.formats.qtool.manifest import parse_manifest, sidecar_path
from qtool.formats.qtool.reader import QtoolReader
from qtool.io.atomic import remove_stale_temps
from qtool.io.checkpoint import open_checkpoint
from qtool.io.stformat import Header, HeaderError, build_header, parse_header, read_header
from tests.corpus import CASES, Case, raw_safetensors

EXHAUSTIVE = os.environ.get("QTOOL_EXHAUSTIVE") == "1"
ERROR_LINE = re.compile(r"^qtool: error: .+\n$")


def _snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every file: inputs must come out of a failure untouched."""
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p)] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_gets_one_line_exit_code_and_loses_nothing(tmp_path: Path, case: Case) -> None:
    (tmp_path / "out").mkdir()
    args = case.setup(tmp_path)
    before = _snapshot(tmp_path)
    out_before = sorted(p.name for p in (tmp_path / "out").iterdir())
    result = CliRunner().invoke(app, args)
    assert result.exit_code == case.code, result.stderr
    assert result.stdout == ""
    if case.code == 1:
        assert ERROR_LINE.match(result.stderr), result.stderr
        assert case.expect in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert _snapshot(tmp_path) == before  # inputs untouched, nothing written beside them
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == out_before
    assert not (tmp_path / "pwned").exists()


# ---- fuzzing: only qtool's own errors may come out of the readers ---------------------------

VALID = raw_safetensors(
    {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
        "c": {"dtype": "I64", "shape": [], "data_offsets": [22, 30]},
    },
    bytes(range(30)),
)
FUZZ = settings(
    max_examples=100_000 if EXHAUSTIVE else 3_000,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


def _mutations() -> st.SearchStrategy[bytes]:
    flips = st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=8)

    def flip(changes: list[tuple[int, int]]) -> bytes:
        data = bytearray(VALID)
        for i, v in changes:
            data[i] = v
        return bytes(data)

    splices = st.tuples(st.integers(0, len(VALID)), st.integers(0, len(VALID)), st.binary())
    return st.one_of(
        st.binary(max_size=200),
        flips.map(flip),
        splices.map(lambda s: VALID[: s[0]] + s[2] + VALID[s[1] :]),
    )


@FUZZ
@given(blob=_mutations())
def test_fuzz_header_parser_raises_only_header_errors(blob: bytes) -> None:
    if len(blob) < 8:
        return
    n = int.from_bytes(blob[:8], "little")
    if 8 + n > len(blob):
        return
    try:
        header = parse_header(blob[8 : 8 + n], len(blob))
    except HeaderError:
        return
    for t in header.tensors:  # whatever is accepted is consistent
        assert 0 <= t.begin <= t.end <= len(blob) - header.data_start


@settings(max_examples=2_000 if not EXHAUSTIVE else 20_000, deadline=None,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(blob=_mutations(), suffix=st.sampled_from([".safetensors", ".bin"]))
def test_fuzz_open_checkpoint_raises_only_qtool_errors(
    tmp_path_factory: pytest.TempPathFactory, blob: bytes, suffix: str
) -> None:
    path = tmp_path_factory.mktemp("fuzz") / f"f{suffix}"
    path.write_bytes(blob)
    try:
        ckpt = open_checkpoint(path)
    except QtoolError:
        return
    for entry in ckpt.entries:
        if entry.dtype in ("F32", "BF16", "I64"):
            ckpt.tensor(entry).sum()
    ckpt.close()


@settings(max_examples=3_000 if not EXHAUSTIVE else 50_000, deadline=None)
@given(
    text=st.one_of(
        st.text(max_size=300),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
            lambda children: (
                st.lists(children, max_size=4)
                | st.dictionaries(st.text(max_size=8), children, max_size=4)
            ),
            max_leaves=20,
        ).map(lambda v: __import__("json").dumps(v)),
    )
)
def test_fuzz_sidecar_manifest_raises_only_sidecar_errors(text: str) -> None:
    with contextlib.suppress(SidecarError):
        parse_manifest(Path("s.qparams.safetensors"), {"qtool.qparams": text})


_PAIR: dict[str, bytes] = {}


def _pair_bytes(directory: Path) -> dict[str, bytes]:
    """A quantized pair (square tensors of one shape: axis and name edits stay plausible) and
    its dequantized output, built once."""
    if not _PAIR:
        gen = torch.Generator().manual_seed(3)
        tensors = {n: torch.randn(4, 4, generator=gen) * (i + 1) for i, n in enumerate("stu")}
        save_file(tensors | {"b": torch.randn(4, generator=gen)}, directory / "m.safetensors")
        q = directory / "q.safetensors"
        api.quantize(directory / "m.safetensors", q, QuantizeOptions(), device="cpu")
        api.dequantize(q, directory / "r.safetensors")
        for key, path in (
            ("q", q),
            ("side", sidecar_path(q)),
            ("out", directory / "r.safetensors"),
        ):
            _PAIR[key] = path.read_bytes()
    return _PAIR


def _edit_manifest(side: bytes, tensor: str, field: str, value: object) -> bytes:
    header = parse_header(side[8 : 8 + int.from_bytes(side[:8], "little")], len(side))
    doc = json.loads((header.metadata or {})["qtool.qparams"])
    doc["tensors"][tensor][field] = value
    tensors = {
        e.name: side[header.data_start + e.begin : header.data_start + e.end]
        for e in header.tensors
    }
    return _resave(side, header, tensors, {"qtool.qparams": json.dumps(doc)})


def _resave(side: bytes, header: Header, data: dict[str, bytes], metadata: dict[str, str]) -> bytes:
    specs = [(e.name, e.dtype, e.shape) for e in header.tensors]
    header_bytes, built = build_header(specs, metadata)
    return header_bytes + b"".join(data[e.name] for e in built.tensors)


_EDITS = st.one_of(
    st.tuples(st.just("side-byte"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("q-header-byte"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(
        st.just("manifest"),
        st.sampled_from("stu"),
        st.sampled_from(["axis", "orig_dtype", "scheme", "dtype", "qmin", "qmax", "shape"]),
        st.sampled_from([0, 1, -1, None, "F32", "BF16", "F16", "F64", "sym", "asym", "int8",
                         "uint8", -127, 127, -128, 255, [4, 4], [16], []]),
    ),
)  # fmt: skip


@settings(max_examples=300 if not EXHAUSTIVE else 10_000, deadline=None)
@given(edit=_EDITS)
def test_fuzz_edited_pair_is_refused_or_decodes_the_same(tmp_path_factory, edit) -> None:  # type: ignore[no-untyped-def]
    """Any edit of the sidecar, or of the quantized file's header, is refused with a QtoolError
    unless it leaves the dequantized tensors exactly as they were: never silently wrong."""
    pair = _pair_bytes(tmp_path_factory.mktemp("pair"))
    q_bytes, side_bytes = pair["q"], pair["side"]
    if edit[0] == "side-byte":
        pos = edit[1] % len(side_bytes)
        side_bytes = side_bytes[:pos] + bytes([side_bytes[pos] ^ edit[2]]) + side_bytes[pos + 1 :]
    elif edit[0] == "q-header-byte":
        pos = 8 + edit[1] % int.from_bytes(q_bytes[:8], "little")
        q_bytes = q_bytes[:pos] + bytes([q_bytes[pos] ^ edit[2]]) + q_bytes[pos + 1 :]
    else:
        side_bytes = _edit_manifest(side_bytes, *edit[1:])
    d = tmp_path_factory.mktemp("edit")
    (d / "q.safetensors").write_bytes(q_bytes)
    (d / "q.qparams.safetensors").write_bytes(side_bytes)
    try:
        api.dequantize(d / "q.safetensors", d / "r.safetensors")
    except QtoolError:
        return
    got = _tensors_of((d / "r.safetensors").read_bytes())
    assert got == _tensors_of(pair["out"])


def _tensors_of(blob: bytes) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Each tensor's dtype, shape and bytes (metadata left out)."""
    header = parse_header(blob[8 : 8 + int.from_bytes(blob[:8], "little")], len(blob))
    start = header.data_start
    return {
        e.name: (e.dtype, e.shape, blob[start + e.begin : start + e.end]) for e in header.tensors
    }


# ---- filesystem faults ----------------------------------------------------------------------


def _checkpoint(path: Path, tensors: int = 8, rows: int = 256, cols: int = 128) -> None:
    gen = torch.Generator().manual_seed(1)
    save_file(
        {f"layer.{i}.weight": torch.randn(rows, cols, generator=gen) for i in range(tensors)}
        | {f"layer.{i}.bias": torch.randn(rows, generator=gen) for i in range(tensors)},
        path,
    )


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


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EIO])
def test_disk_full_at_every_write_leaves_nothing(tmp_path: Path, code: int) -> None:
    """Inject an OSError at write call k for every k a quantize run makes."""
    src, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    _checkpoint(src)
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
    _checkpoint(tmp_path / "m.safetensors")

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


def test_preflight_refuses_before_reading(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "m.safetensors")
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


def test_output_mode_follows_umask(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "m.safetensors", tensors=1)
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


def test_stale_temps_of_dead_runs_are_removed(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "m.safetensors", tensors=1)
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


def test_where_locks_are_not_enforced_only_old_temps_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qtool.io import atomic

    monkeypatch.setattr(atomic, "_locks_enforced", lambda directory: False)
    young = tmp_path / f".q.safetensors.qtool-tmp-{_dead_pid()}-00000001"
    old = tmp_path / f".q.safetensors.qtool-tmp-{_dead_pid()}-00000002"
    for p in (young, old):
        p.write_bytes(b"x")
    past = time.time() - atomic.STALE_AGE_S - 60
    os.utime(old, (past, past))
    assert remove_stale_temps(tmp_path) == 1
    assert young.exists() and not old.exists()


def test_lock_probe_sees_enforced_locks_here(tmp_path: Path) -> None:
    from qtool.io.atomic import _locks_enforced

    assert _locks_enforced(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


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


# ---- signals and kills ----------------------------------------------------------------------


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
    _checkpoint(tmp_path / "m.safetensors", tensors=96, rows=2048, cols=512)
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
    _checkpoint(src, tensors=48, rows=2048)
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
    # A clean run afterwards removes every temp file the kills left behind.
    subprocess.run([sys.executable, "-m", "qtool", "quantize", str(src), "-o", str(out), "--force"],
                   check=True, capture_output=True)  # fmt: skip
    assert not [p for p in tmp_path.iterdir() if ".qtool-tmp-" in p.name]
    print(f"kills survived: {kills}, states: {states}")
