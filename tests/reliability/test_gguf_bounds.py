"""Issue 28, the GGUF part: a small hostile GGUF file never buys unbounded work (class 3), never
gets a traceback (class 4) and never gives a silently wrong output (class 5). Each test names
the class it holds and attacks it through the commands; work is bounded by counting calls and
memory by a cap (RLIMIT_AS) in a subprocess, never by timing."""

from __future__ import annotations

import os
import resource
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import Invoke
from tests.corpus_gguf import CASES, STRING, UINT32, gguf, kv, kv_u32, s, ti
from tests.gguf_files import SAMPLE, sample_variant

pytest.importorskip("gguf")

HF = SAMPLE.parent / "tiny-llama"  # the Hugging Face checkpoint the sample GGUF was made from
ARCH = kv("general.architecture", STRING, s("llama"))
Q4_0, Q8_0 = 2, 8
UINT16 = 2


def _refused(invoke: Invoke, args: list[str], path: Path, *expect: str) -> str:
    """One line naming `path` (and saying each of `expect`), exit 1, nothing on stdout."""
    code, out, err = invoke(*args)
    lines = err.strip().splitlines()
    assert code == 1 and out == "", (args, code, out, err)
    assert len(lines) == 1 and lines[0].startswith(f"qtool: error: {path}: "), err
    for text in expect:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def _commands(path: Path, out: Path, tensor: str = "w") -> dict[str, list[str]]:
    """Every command that reads the tensors of the GGUF file `path`."""
    return {
        "dequantize": ["dequantize", str(path), "-o", str(out / "o.safetensors")],
        "compare": ["compare", str(SAMPLE), str(path)],
        "quantize": ["quantize", str(path), "--format", "gguf", "--dtype", "Q8_0", "-o",
                     str(out / "q.gguf")],
        "plot": ["plot", str(path), "-t", tensor, "-o", str(out / "p.png")],
    }  # fmt: skip


# ---- class 3: work and memory bounded by the file and what was asked, not by a number in it


def test_class3_each_header_entry_is_parsed_once_whatever_the_prefix_read(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A header larger than the first read is read on, not parsed again from the start, and
    detect and inspect share one parse: 3,000 tensor infos and 3,000 keys are 3,000 calls each
    (the restarts parsed them once per doubling of the prefix, and again for each command's
    open)."""
    from qtool.io import gguf_file, gguf_header

    n = 3_000
    path = tmp_path / "many.gguf"
    kvs = [ARCH] + [kv_u32(f"k{i}", i) for i in range(n - 1)]
    path.write_bytes(gguf(kvs, infos=[ti(f"t{i}", [0]) for i in range(n)]))
    monkeypatch.setattr(gguf_file, "FIRST_READ", 4096)
    calls = {"_tensor_info": 0, "_value": 0}
    for name in calls:
        original = getattr(gguf_header, name)

        def counted(
            *args: object, _name: str = name, _f: Callable[..., object] = original
        ) -> object:
            calls[_name] += 1
            return _f(*args)

        monkeypatch.setattr(gguf_header, name, counted)
    code, out, err = invoke("inspect", str(path), "--json")
    assert code == 0, err
    assert calls == {"_tensor_info": n, "_value": n}


@pytest.mark.parametrize("case", ["too-many-tensors", "too-many-keys", "alignment-2^30"])
def test_class3_counts_and_alignment_over_the_documented_bounds_are_refused(
    invoke: Invoke, tmp_path: Path, case: str
) -> None:
    """65,537 zero-size tensors or keys fit in 1.6 MB (each entry is at least 25 or 14 bytes):
    refused by their count, before one is parsed; an alignment of 2^30 (3 GiB of padding for
    two 8 KiB tensors, while the report said 4.2 KiB) is refused before anything is written."""
    found = next(c for c in CASES if c.id == case)
    path = tmp_path / "bad.gguf"
    path.write_bytes(found.content)
    for args in [["inspect", str(path)], *_commands(path, tmp_path).values()]:
        _refused(invoke, args, path, found.expect)
    assert sorted(os.listdir(tmp_path)) == ["bad.gguf"]


@pytest.mark.parametrize("declared", [3, 100_000, 10**8])
def test_class3_the_name_map_is_built_for_the_blocks_the_tensors_name(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, declared: int
) -> None:
    """llama.block_count = 10^5 in a 480-byte file cost 97 s and 5.4 GB (10^8: MemoryError):
    gguf's TensorNameMap was built for that many blocks. It is built for the blocks the tensors
    name, and a block_count beyond them is refused naming the file and the key."""
    import gguf as gguf_py

    built: list[int] = []
    original = gguf_py.TensorNameMap

    def spy(arch: object, n_blocks: int) -> object:
        built.append(n_blocks)
        if n_blocks > 512:
            raise AssertionError(f"a name map of {n_blocks} blocks")
        return original(arch, n_blocks)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf_py, "TensorNameMap", spy)
    path = sample_variant(tmp_path / "blocks.gguf", llama__block_count=declared)
    _refused(invoke, ["compare", str(HF), str(path)], path, f"llama.block_count is {declared}",
             "its tensors name blocks 0 to 1")  # fmt: skip
    far = tmp_path / "far.gguf"  # one tensor in block 99,999: no map of 100,000 blocks either
    far.write_bytes(gguf([ARCH], infos=[ti("blk.99999.ffn_norm.weight", [8])], data=bytes(32)))
    _refused(invoke, ["compare", str(HF), str(far)], far, "over llama.cpp's limit of 512 blocks")
    code, _, err = invoke("compare", str(HF), str(SAMPLE))
    assert code == 0, err
    assert built == [2]


_CAPPED = """
import resource, sys
cap = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
from qtool.cli.app import main
main(sys.argv[2:])
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and sparse files")
def test_class3_a_tensor_larger_than_memory_is_named_not_an_internal_error(
    tmp_path: Path,
) -> None:
    """A 4 KB sparse GGUF declaring one 8 GiB tensor, under a 3 GiB address-space cap: compare,
    which reads tensors whole, fails with one line naming the file and the tensor (it was
    `internal error: OSError: [Errno 12]` or MemoryError, no file named). dequantize and
    quantize read it a slab at a time (test_gguf_streaming.py)."""
    path = tmp_path / "sparse.gguf"
    head = gguf([ARCH, kv_u32("llama.block_count", 1)],
                infos=[ti("blk.0.ffn_up.weight", [65536, 32768])])  # fmt: skip
    with path.open("wb") as f:
        f.write(head)
        f.truncate(len(head) + (8 << 30))
    assert path.stat().st_blocks * 512 < 1 << 20
    cap = 3 << 30
    commands = _commands(path, tmp_path) | {"compare": ["compare", str(path), str(path)]}
    for name in ("compare",):
        done = subprocess.run(
            [sys.executable, "-c", _CAPPED, str(cap), *commands[name]],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "QTOOL_KERNEL": "torch"},
        )  # fmt: skip
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1, (name, done.stderr)
        assert len(lines) == 1, (name, done.stderr)
        assert lines[0].startswith(f"qtool: error: {path}: tensor 'blk.0.ffn_up.weight': "), lines
        assert "memory qtool may use" in lines[0] and "internal" not in lines[0], lines
    assert sorted(os.listdir(tmp_path)) == ["sparse.gguf"]
    assert resource.getrlimit(resource.RLIMIT_AS)[0] != cap  # only the child was capped


# ---- class 4: no traceback, ever


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ({"llama__attention__head_count": 3}, "llama.attention.head_count is 3, but "
         "blk.0.attn_q.weight has 64 rows, not 3 heads of pairs"),
        ({"llama__attention__head_count_kv": 3}, "llama.attention.head_count_kv is 3, but "
         "blk.0.attn_k.weight has 32 rows"),
        ({"llama__attention__head_count_kv": -2}, "head_count_kv is -2: a head count cannot "
         "be negative"),
        ({"llama__attention__head_count": -4}, "no single positive llama.attention.head_count"),
    ],
)  # fmt: skip
def test_class4_head_counts_that_cannot_unpermute_the_rows_are_refused_by_key(
    invoke: Invoke, tmp_path: Path, change: dict[str, int], expect: str
) -> None:
    """The q/k rows are un-permuted with the head counts: counts that do not divide them (or
    are negative) were internal errors (a reshape's ValueError); now one line naming the file
    and the key, before any tensor is read."""
    path = sample_variant(tmp_path / "heads.gguf", **change)
    _refused(invoke, ["compare", str(HF), str(path)], path, expect)


def test_class4_names_no_writer_can_write_are_refused_when_read(
    invoke: Invoke, tmp_path: Path
) -> None:
    """An empty tensor name was read, then `quantize --format gguf` failed with an internal
    ValueError from the GGUF writer: every command refuses it when it reads the header."""
    path = tmp_path / "empty.gguf"
    path.write_bytes(gguf([ARCH], infos=[ti("", [32, 2])], data=bytes(256)))
    for args in [["inspect", str(path)], *_commands(path, tmp_path).values()]:
        _refused(invoke, args, path, "tensor 0 has an empty name")
    assert sorted(os.listdir(tmp_path)) == ["empty.gguf"]


def test_class4_an_unknown_architecture_is_a_bad_input_naming_the_file(
    invoke: Invoke, tmp_path: Path
) -> None:
    """It exited 2 (a usage error) naming no file; the file is the problem, or the gguf
    package is too old: exit 1, the file and the version named, what to do said."""
    path = sample_variant(tmp_path / "arch.gguf", general__architecture=_string("nosucharch"))
    _refused(invoke, ["compare", str(HF), str(path)], path, "general.architecture is "
             "'nosucharch'", "installed gguf package (version ", "pip install -U gguf")  # fmt: skip
    path = sample_variant(tmp_path / "long.gguf", general__architecture=_string("a" * (5 << 20)))
    line = _refused(invoke, ["compare", str(HF), str(path)], path, "5,242,880 characters long")
    assert len(line) < 500


def _string(text: str) -> object:
    from qtool.gguf_types import ValueType
    from qtool.io.gguf_layout import GGUFValue

    return GGUFValue(ValueType.STRING, text)


# ---- class 5: no silently wrong output


def _q4_0(scale: float, code_byte: int) -> bytes:
    """Two Q4_0 blocks (a row of 64): an fp16 scale and 16 bytes of nibbles each."""
    return (np.float16(scale).tobytes() + bytes([code_byte] * 16)) * 2


@pytest.mark.parametrize(
    ("gtype", "blocks", "to", "expect"),
    [
        (Q4_0, _q4_0(np.inf, 0xFF), "float32", "NaN/Inf scales"),
        (Q4_0, _q4_0(np.nan, 0x11), "original", "NaN/Inf scales"),
        (Q4_0, _q4_0(65504, 0x00), "float16", "overflow float16 to infinity"),
        (Q8_0, (np.float16(-np.inf).tobytes() + bytes(32)) * 2, "bfloat16", "NaN/Inf scales"),
    ],
    ids=["q4_0-inf-scale", "q4_0-nan-scale", "q4_0-65504-to-float16", "q8_0-minus-inf-scale"],
)
def test_class5_block_scales_that_give_nan_or_inf_are_refused_by_tensor(
    invoke: Invoke, tmp_path: Path, gtype: int, blocks: bytes, to: str, expect: str
) -> None:
    """Q4_0 blocks with an infinite scale dequantized to all-NaN (exit 0), a scale of 65504
    with --to float16 to -inf (exit 0); qtool's other formats refuse both. Refused naming the
    file and the tensor, by dequantize and compare alike; nothing written."""
    path = tmp_path / "scales.gguf"
    row = len(blocks)
    path.write_bytes(gguf([ARCH], infos=[ti("blk.0.ffn_up.weight", [64, 1], gtype)],
                          data=blocks + bytes(-row % 32)))  # fmt: skip
    out = tmp_path / "o.safetensors"
    args = ["dequantize", str(path), "-o", str(out), "--to", to]
    line = _refused(invoke, args, path, expect)
    assert "tensor 'blk.0.ffn_up.weight'" in line
    if "overflow" in expect:
        code, _, err = invoke("dequantize", str(path), "-o", str(out), "--to", "float32")
        assert code == 0, err
        out.unlink()
    else:
        _refused(invoke, ["compare", str(path), str(path)], path, expect)
    assert sorted(os.listdir(tmp_path)) == ["scales.gguf"]


def test_class5_shapes_whose_product_overflows_after_a_zero_are_refused(
    invoke: Invoke, tmp_path: Path
) -> None:
    """torch shape [2^62, 2^62, 0] (GGUF [0, 2^62, 2^62]): 0 elements, but its running
    product overflows int64 in the order safetensors and torch compute it. It dequantized
    into a file neither loads, and `plot` was an internal error."""
    found = next(c for c in CASES if c.id == "overflow-after-a-zero")
    path = tmp_path / "dims.gguf"
    path.write_bytes(found.content)
    for args in [["inspect", str(path)], *_commands(path, tmp_path).values()]:
        _refused(invoke, args, path, found.expect)
    assert sorted(os.listdir(tmp_path)) == ["dims.gguf"]


def test_class5_a_name_safetensors_reserves_is_refused_for_a_safetensors_output(
    invoke: Invoke, tmp_path: Path
) -> None:
    """A GGUF tensor named __metadata__ was dequantized (exit 0) into a .safetensors that
    qtool and the safetensors library refuse; a .pt output holds it."""
    path = tmp_path / "meta.gguf"
    path.write_bytes(gguf([ARCH], infos=[ti("__metadata__", [4, 2])], data=bytes(32)))
    out = tmp_path / "o.safetensors"
    _refused(invoke, ["dequantize", str(path), "-o", str(out)], path,
             "tensor '__metadata__': safetensors reserves this name")  # fmt: skip
    assert not out.exists()
    code, _, err = invoke("dequantize", str(path), "-o", str(tmp_path / "o.pt"))
    assert code == 0, err


def test_class5_a_split_part_is_refused_by_every_command_reading_tensors(
    invoke: Invoke, tmp_path: Path
) -> None:
    """`quantize --format gguf` wrote part 1 of 2 as a whole model (and dequantize wrote
    half a model): every command reading the model refuses it alike, saying how to merge;
    inspect shows which part it is, and plot draws a tensor (a part holds it whole)."""
    split = {"split__no": _u16(0), "split__count": _u16(2)}
    path = sample_variant(tmp_path / "part.gguf", **split)
    commands = _commands(path, tmp_path, "blk.0.attn_q.weight")
    plot = commands.pop("plot")  # one tensor, which a part holds whole: drawn
    for args in commands.values():
        _refused(invoke, args, path, "part 1 of 2 of a split GGUF", "llama-gguf-split --merge")
    _refused(invoke, ["compare", str(HF), str(path)], path, "part 1 of 2")
    code, out, err = invoke("inspect", str(path))
    assert code == 0 and "part 1 of 2" in out, err
    assert sorted(os.listdir(tmp_path)) == ["part.gguf"]
    code, out, err = invoke(*plot)
    assert code == 0, err


def _u16(n: int) -> object:
    from qtool.gguf_types import ValueType
    from qtool.io.gguf_layout import GGUFValue

    return GGUFValue(ValueType.UINT16, n)


def test_class5_inspect_shows_a_bounded_prefix_of_long_strings_and_their_length(
    invoke: Invoke, tmp_path: Path
) -> None:
    """Two 5 MB metadata strings were printed whole (10 MB of console): 256 characters of
    each, and how long it is, in the console and in JSON."""
    big = "n" * (5 << 20)
    path = tmp_path / "long.gguf"
    path.write_bytes(gguf([kv("general.architecture", STRING, s(big)),
                           kv("general.name", STRING, s(big)),
                           kv("general.basename", STRING, s(big)),
                           kv("llama.block_count", UINT32, struct.pack("<I", 1))]))  # fmt: skip
    for extra in ([], ["--json"]):
        code, out, err = invoke("inspect", str(path), *extra)
        assert code == 0, err
        assert len(out) < 8_000, len(out)
        assert out.count("5,242,880 characters") == 3, out
