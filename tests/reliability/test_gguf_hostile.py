"""The GGUF read path attacked through the commands, as a hostile local user would: a truncated
file, huge tensor counts and dimensions, data offsets past the end, overlapping tensors, a
FIFO, a device, a directory, symlinks (to a FIFO, to the input as -o) and terminal escapes in
names. Each is refused by inspect, dequantize, compare and quantize alike with one line naming
the file and what is wrong (exit 1), nothing written and the file left as it was; the library
level (every rule of the header, bounded allocation, truncation while open) is
tests/io/test_gguf_io.py and tests/io/test_gguf_read.py."""

from __future__ import annotations

import os
import signal
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import Invoke
from tests.corpus_gguf import CASES, DATA, STRING, W, gguf, kv, s, ti

pytest.importorskip("gguf")

SAMPLE = Path(__file__).parents[2] / "sample_weights" / "tiny-llama.gguf"

COMMANDS: dict[str, Callable[[Path, Path], list[str]]] = {
    "inspect": lambda p, out: ["inspect", str(p)],
    "dequantize": lambda p, out: ["dequantize", str(p), "-o", str(out / "o.safetensors")],
    "compare": lambda p, out: ["compare", str(SAMPLE), str(p)],
    "quantize": lambda p, out: [
        "quantize",
        str(p),
        "--format",
        "gguf",
        "--dtype",
        "Q8_0",
        "-o",
        str(out / "q.gguf"),
    ],  # fmt: skip
}

# the attacks the issue names, from the corpus (each breaks one rule of the header)
ATTACKS = {
    "huge-n-tensors": "declares 9223372036854775808 tensors",
    "numel-overflow": "negative or too big",
    "tensor-far-away": "ends at byte",
    "data-truncated": "ends at byte",
    "overlap": "but tensors follow one another in order",
    "infos-truncated": "truncated: the offset of 'w'",
}


@pytest.fixture(autouse=True)
def _no_hang() -> Iterator[None]:
    """A command blocked on a FIFO fails the test instead of hanging the run."""

    def hung(signum: int, frame: object) -> None:
        raise TimeoutError("the command blocked")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _refused(invoke: Invoke, args: list[str], path: Path, expect: str) -> str:
    code, out, err = invoke(*args)
    lines = err.strip().splitlines()
    assert code == 1, (args, code, out, err)
    assert len(lines) == 1 and lines[0].startswith(f"qtool: error: {path}: "), err
    assert expect in lines[0], (expect, lines[0])
    assert "Traceback" not in out + err
    return lines[0]


def _only(directory: Path, *names: str) -> None:
    assert sorted(os.listdir(directory)) == sorted(names)


@pytest.mark.parametrize("case", [c for c in CASES if c.content.startswith(b"GGUF")],
                         ids=lambda c: c.id)  # fmt: skip
def test_every_bad_header_of_the_corpus_is_one_clear_line(
    invoke: Invoke, tmp_path: Path, case: object
) -> None:
    from tests.corpus_gguf import GGUFCase

    assert isinstance(case, GGUFCase)
    path = tmp_path / "bad.gguf"
    path.write_bytes(case.content)
    line = _refused(invoke, ["inspect", str(path)], path, case.expect)
    assert line.startswith(f"qtool: error: {path}: not a valid GGUF file: ")
    assert path.read_bytes() == case.content


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("attack", ATTACKS)
def test_each_command_refuses_each_attack_and_writes_nothing(
    invoke: Invoke, tmp_path: Path, command: str, attack: str
) -> None:
    content = next(c.content for c in CASES if c.id == attack)
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    _refused(invoke, COMMANDS[command](path, tmp_path), path, ATTACKS[attack])
    _only(tmp_path, "bad.gguf")
    assert path.read_bytes() == content


@pytest.mark.parametrize("command", COMMANDS)
def test_a_real_file_cut_short_is_refused_by_name(
    invoke: Invoke, tmp_path: Path, command: str
) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(SAMPLE.read_bytes()[:100_000])
    line = _refused(invoke, COMMANDS[command](path, tmp_path), path, "truncated: tensor '")
    assert "of a 100000-byte file" in line
    _only(tmp_path, "cut.gguf")


@pytest.mark.parametrize("command", COMMANDS)
def test_special_files_and_links_to_them_are_refused_without_blocking(
    invoke: Invoke, tmp_path: Path, command: str
) -> None:
    os.mkfifo(tmp_path / "fifo.gguf")
    (tmp_path / "link.gguf").symlink_to(tmp_path / "fifo.gguf")
    (tmp_path / "zero.gguf").symlink_to("/dev/zero")
    (tmp_path / "dir.gguf").mkdir()
    expect = {"fifo.gguf": "(a FIFO)", "link.gguf": "(a FIFO)", "zero.gguf": "(a device)",
              "dir.gguf": "directory"}  # fmt: skip
    for name, what in expect.items():
        path = tmp_path / name
        _refused(invoke, COMMANDS[command](path, tmp_path), path, what)
    _only(tmp_path, *expect)


def test_a_symlink_named_on_the_command_line_is_read_but_never_written_through(
    invoke: Invoke, tmp_path: Path
) -> None:
    src = tmp_path / "in.gguf"
    src.write_bytes(SAMPLE.read_bytes())
    (tmp_path / "link.gguf").symlink_to(src)
    code, out, err = invoke("inspect", str(tmp_path / "link.gguf"))
    assert code == 0 and "21 tensors" in out, err
    for target in ("in.gguf", "link.gguf"):  # -o the input itself, or a link to it
        out_path = tmp_path / target
        args = ["quantize", str(tmp_path / "link.gguf"), "--format", "gguf", "--dtype", "Q8_0",
                "-o", str(out_path)]  # fmt: skip
        _refused(invoke, args, out_path, "would overwrite the input")
    assert src.read_bytes() == SAMPLE.read_bytes()
    _only(tmp_path, "in.gguf", "link.gguf")


def test_escapes_in_names_and_metadata_are_shown_not_obeyed(invoke: Invoke, tmp_path: Path) -> None:
    name = kv("general.name", STRING, s("x\x1b]0;pwned\x07"))
    path = tmp_path / "esc.gguf"
    path.write_bytes(gguf([name], infos=[ti("w\x1b[2J", [4, 2])], data=DATA))
    code, out, err = invoke("inspect", str(path))
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out
    assert "w\\x1b[2J" in out
    code, out, err = invoke("inspect", str(path), "--json")
    assert code == 0 and "\x1b" not in out, err


def test_a_tensor_count_past_the_infos_is_refused(invoke: Invoke, tmp_path: Path) -> None:
    """One tensor info, a count of two: the second is read past the end of the file."""
    content = gguf(infos=[W], data=DATA, n_tensors=2)
    path = tmp_path / "count.gguf"
    path.write_bytes(content)
    _refused(invoke, ["inspect", str(path)], path, "not a valid GGUF file: ")
    assert struct.unpack_from("<Q", path.read_bytes(), 8)[0] == 2


@pytest.mark.parametrize("command", ["dequantize", "quantize"])
def test_a_file_cut_short_during_the_run_is_an_error_not_sigbus(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """Cut to its header (another process truncating it) once the run has read the header:
    the next tensor read comes up short, an error naming the file; no output is left."""
    from qtool.formats.gguf.reader import GGUFFloatReader
    from qtool.io.checkpoint import Checkpoint

    src = tmp_path / "in.gguf"
    src.write_bytes(SAMPLE.read_bytes())
    for cls, method in ((GGUFFloatReader, "values"), (GGUFFloatReader, "raw"),
                        (Checkpoint, "rows"), (Checkpoint, "tensors")):  # fmt: skip
        original = getattr(cls, method)

        def cut(*args: object, _original: Callable[..., object] = original) -> object:
            os.truncate(src, 4096)
            return _original(*args)

        monkeypatch.setattr(cls, method, cut)
    code, out, err = invoke(*COMMANDS[command](src, tmp_path))
    assert code == 1, (out, err)
    assert err.startswith(f"qtool: error: {src}: ") and len(err.strip().splitlines()) == 1, err
    assert "changed" in err, err
    _only(tmp_path, "in.gguf")
