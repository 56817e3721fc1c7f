"""Bad inputs and faults: every one answered with one clear line, nothing lost, nothing left."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import re
import signal
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

from qtool import pipeline, restore
from qtool.checkpoint import open_checkpoint
from qtool.cli import app
from qtool.errors import OutputError, QtoolError, SidecarError
from qtool.plan import QuantizeOptions
from qtool.sidecar import parse_manifest, sidecar_path
from qtool.stformat import HeaderError, parse_header, read_header
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
    from qtool.atomic import OutputSet

    create = OutputSet.create
    _FaultyFile.calls = 0

    def faulty(self: OutputSet, final: Path, *, last: bool = False) -> object:
        return _FaultyFile(create(self, final, last=last), fail_at, code)

    mp.setattr(OutputSet, "create", faulty)
    pipeline.quantize_file(src, out, QuantizeOptions(), device="cpu")


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
            pipeline.quantize_file(
                tmp_path / "m.safetensors", tmp_path / "q.safetensors", QuantizeOptions(),
                device="cpu",
            )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_preflight_refuses_before_reading(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "m.safetensors")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "access", lambda path, mode: not mode & os.W_OK)
        with pytest.raises(OutputError, match="not writable"):
            pipeline.quantize_file(
                tmp_path / "m.safetensors", tmp_path / "q.safetensors", QuantizeOptions(),
                device="cpu",
            )  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        import shutil

        mp.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 10))  # type: ignore[attr-defined]
        with pytest.raises(OutputError, match="has 10 free"):
            pipeline.quantize_file(
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
            pipeline.quantize_file(tmp_path / "m.safetensors", out, QuantizeOptions(), device="cpu")
        finally:
            os.umask(old)
        assert out.stat().st_mode & 0o777 == 0o666 & ~umask
        assert sidecar_path(out).stat().st_mode & 0o777 == 0o666 & ~umask


def test_stale_temps_of_dead_runs_are_removed(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "m.safetensors", tensors=1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    stale = tmp_path / f".q.safetensors.qtool-tmp-{dead}-abcd1234"
    stale.write_bytes(b"half a file")
    alive = tmp_path / f".q.safetensors.qtool-tmp-{os.getpid()}-abcd1234"
    alive.write_bytes(b"another run, still going")
    summary = pipeline.quantize_file(
        tmp_path / "m.safetensors", tmp_path / "q.safetensors", QuantizeOptions(), device="cpu"
    )
    assert summary.stale_temps_removed == 1
    assert not stale.exists() and alive.exists()


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
        restore.open_quantized(out).close()
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
    assert sum(states.values()) == kills
    print(f"kills survived: {kills}, states: {states}")
