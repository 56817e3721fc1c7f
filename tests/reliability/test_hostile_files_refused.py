"""Hostile files are refused in one line: the corpus of bad safetensors/qtool files
(tests/corpus.py), fuzzed headers, sidecar manifests and edited quantized pairs, and a model
directory's unreadable config.json. Each answer is one line naming the file, exit 1, nothing
written and the inputs untouched; a fuzzed file is refused or decodes to the same values.
GGUF files: test_gguf_hostile.py and test_gguf_bounds.py; imatrix files: test_imatrix_hostile.py;
files that change while read, closed streams: test_hostile_inputs.py."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
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
from qtool.errors import QtoolError, SidecarError
from qtool.formats.qtool.manifest import parse_manifest, sidecar_path
from qtool.io.checkpoint import open_checkpoint
from qtool.io.stformat import Header, HeaderError, build_header, parse_header
from tests.conftest import SAMPLES
from tests.conftest import run_qtool as invoke
from tests.corpus import CASES, Case, raw_safetensors
from tests.outputs import CT, ERROR_LINE, EXHAUSTIVE


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
