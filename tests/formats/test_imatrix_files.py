"""formats/imatrix: llama-imatrix's own files for SmolLM2-135M (../shared/data, beside the
repository) read in both formats to the same statistics and written back byte for byte; written
files read back (several matrices per weight, in_sum) and by gguf-py; merges as llama-imatrix
--in-file makes them; llama.cpp's names mapped to SmolLM2's Hugging Face names."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from qtool.formats.imatrix import hf_names_of, read_imatrix, write_imatrix
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats, merge

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
GGUF = DATA / "smollm2-135m-pydoc.imatrix.gguf"
DAT = DATA / "smollm2-135m-pydoc.imatrix.dat"
needs_data = pytest.mark.skipif(
    not (GGUF.is_file() and DAT.is_file()),
    reason=f"llama-imatrix's SmolLM2 files are not in {DATA} (the shared/ checkout beside qtool)",
)

PARTS = ("attn_k", "attn_output", "attn_q", "attn_v", "ffn_down", "ffn_gate", "ffn_up")
HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip


def smollm2_hf_names(n_blocks: int = 30) -> list[str]:
    """The weight names of SmolLM2-135M's Hugging Face checkpoint (tied: no lm_head)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(n_blocks):
        names += [f"model.layers.{i}.{m}.weight" for m in HF.values()]
        names += [f"model.layers.{i}.{n}.weight" for n in ("input_layernorm",
                                                         "post_attention_layernorm")]  # fmt: skip
    return names


@needs_data
def test_llama_imatrix_files_hold_what_the_run_collected() -> None:
    """30 blocks x 7 Linears, one matrix each, 128 chunks of 512 tokens = 65,536 rows."""
    m = read_imatrix(GGUF)
    assert sorted(m.entries) == sorted(f"blk.{i}.{p}.weight" for i in range(30) for p in PARTS)
    assert (m.chunk_size, m.chunk_count, m.datasets) == (512, 128, ("calib.txt",))
    for name, s in m.entries.items():
        assert s.n_mat == 1 and s.in_sum is None
        assert s.k == (1536 if "ffn_down" in name else 576)
        np.testing.assert_array_equal(s.counts, [128 * 512])
    for i in range(30):  # q, k and v read one input, gate and up another: the same sums
        e = {p: m.entries[f"blk.{i}.{p}.weight"].sums for p in PARTS}
        assert e["attn_q"].tobytes() == e["attn_k"].tobytes() == e["attn_v"].tobytes()
        assert e["ffn_gate"].tobytes() == e["ffn_up"].tobytes()


@needs_data
def test_the_dat_and_the_gguf_of_one_run_read_the_same() -> None:
    """The .dat stores sum / 65536 * 128 (powers of two: exact); read back times 512 as
    llama-imatrix reads it, every sum and count equals the GGUF's, bit for bit."""
    g, d = read_imatrix(GGUF), read_imatrix(DAT)
    assert sorted(g.entries) == sorted(d.entries)
    assert (d.chunk_size, d.chunk_count, d.datasets) == (g.chunk_size, g.chunk_count, g.datasets)
    for name, s in g.entries.items():
        assert d.entries[name].sums.tobytes() == s.sums.tobytes(), name
        np.testing.assert_array_equal(d.entries[name].counts, s.counts)


@needs_data
@pytest.mark.parametrize("source", [GGUF, DAT], ids=["from-gguf", "from-dat"])
def test_written_back_byte_for_byte(source: Path, tmp_path: Path) -> None:
    """Whether read from the GGUF or the .dat, qtool writes llama-imatrix's GGUF exactly."""
    out = tmp_path / "out.imatrix.gguf"
    write_imatrix(out, read_imatrix(source))
    assert out.read_bytes() == GGUF.read_bytes()


@needs_data
def test_merging_a_file_with_itself_doubles_it(tmp_path: Path) -> None:
    """What llama-imatrix --in-file A --in-file A writes: sums x 2 (exact), counts x 2,
    chunk_count = 131072 // 512, both datasets listed."""
    m = read_imatrix(GGUF)
    twice = merge(m, m)
    assert (twice.chunk_count, twice.datasets) == (256, ("calib.txt", "calib.txt"))
    for name, s in m.entries.items():
        np.testing.assert_array_equal(twice.entries[name].sums, s.sums * 2)
        np.testing.assert_array_equal(twice.entries[name].counts, s.counts * 2)
    write_imatrix(tmp_path / "twice.gguf", twice)
    back = read_imatrix(tmp_path / "twice.gguf")
    assert back.chunk_count == 256 and back.entries.keys() == twice.entries.keys()


@needs_data
def test_smollm2_names_map_to_its_hugging_face_names() -> None:
    pytest.importorskip("gguf")
    m = read_imatrix(GGUF)
    names = hf_names_of(m, "llama", 30, smollm2_hf_names())
    assert len(names) == 210
    hf = m.renamed(names)
    for i in (0, 17, 29):
        for part, module in HF.items():
            assert (
                hf.entries[f"model.layers.{i}.{module}.weight"]
                is m.entries[f"blk.{i}.{part}.weight"]
            )


def test_names_map_without_the_shared_files() -> None:
    """The same mapping on a made-up imatrix of SmolLM2's layout (runs without ../shared)."""
    pytest.importorskip("gguf")
    one = MatrixStats(np.ones((1, 4), np.float32), np.ones(1, np.int64))
    names = [f"blk.{i}.{p}.weight" for i in range(3) for p in PARTS] + ["output.weight"]
    m = ImportanceMatrix(dict.fromkeys(names, one), 512, 0)
    mapped = hf_names_of(m, "llama", 3, smollm2_hf_names(3) + ["lm_head.weight"])
    assert mapped["blk.2.attn_q.weight"] == "model.layers.2.self_attn.q_proj.weight"
    assert mapped["blk.0.ffn_down.weight"] == "model.layers.0.mlp.down_proj.weight"
    assert mapped["output.weight"] == "lm_head.weight"
    assert len(mapped) == len(names)
    assert "output.weight" not in hf_names_of(m, "llama", 3, smollm2_hf_names(3))  # tied


def made_up() -> ImportanceMatrix:
    """Every shape the writer has to get right: experts (n_mat > 1), in_sum, K = 1."""
    rng = np.random.default_rng(0)
    counts = np.array([3, 0, 9, 2], np.int64)  # expert 1 never routed to: no rows, zero sums
    experts = MatrixStats(rng.random((4, 8), dtype=np.float32) * (counts[:, None] > 0), counts)
    mean = MatrixStats(
        rng.random((1, 32), dtype=np.float32),
        np.array([70], np.int64),
        rng.standard_normal((1, 32), dtype=np.float32),
    )
    single = MatrixStats(np.full((1, 1), 0.5, np.float32), np.array([1], np.int64))
    entries = {"blk.1.ffn_up_exps.weight": experts, "blk.0.attn_q.weight": mean, "w": single}
    return ImportanceMatrix(entries, 16, 4, ("a.txt", "b.jsonl"))


def test_write_then_read(tmp_path: Path) -> None:
    m = made_up()
    write_imatrix(tmp_path / "m.gguf", m)
    back = read_imatrix(tmp_path / "m.gguf")
    assert (back.chunk_size, back.chunk_count, back.datasets) == (16, 4, ("a.txt", "b.jsonl"))
    assert list(back.entries) == sorted(m.entries)  # llama-imatrix's order: names sorted
    for name, s in m.entries.items():
        b = back.entries[name]
        assert b.sums.tobytes() == s.sums.tobytes()
        np.testing.assert_array_equal(b.counts, s.counts)
        assert (b.in_sum is None) == (s.in_sum is None)
        if s.in_sum is not None:
            assert b.in_sum is not None and b.in_sum.tobytes() == s.in_sum.tobytes()


def test_gguf_py_reads_what_qtool_writes(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    write_imatrix(tmp_path / "m.gguf", made_up())
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert r.fields["general.type"].contents() == "imatrix"
    assert r.fields["imatrix.datasets"].contents() == ["a.txt", "b.jsonl"]
    assert r.fields["imatrix.chunk_count"].contents() == 4
    assert r.fields["imatrix.chunk_size"].contents() == 16
    tensors = {t.name: t for t in r.tensors}
    assert list(tensors) == [
        "blk.0.attn_q.weight.in_sum2", "blk.0.attn_q.weight.counts", "blk.0.attn_q.weight.in_sum",
        "blk.1.ffn_up_exps.weight.in_sum2", "blk.1.ffn_up_exps.weight.counts", "w.in_sum2",
        "w.counts",
    ]  # fmt: skip
    exps = tensors["blk.1.ffn_up_exps.weight.in_sum2"]
    assert list(exps.shape) == [8, 4]  # GGUF order: [K, n_mat]
    np.testing.assert_array_equal(
        np.asarray(exps.data).reshape(4, 8), made_up().entries["blk.1.ffn_up_exps.weight"].sums
    )
    counts = tensors["blk.1.ffn_up_exps.weight.counts"]
    assert list(counts.shape) == [1, 4]
    np.testing.assert_array_equal(np.asarray(counts.data).ravel(), [3, 0, 9, 2])
    assert list(tensors["w.in_sum2"].shape) == [1]  # ggml_n_dims drops trailing 1s


def test_the_header_is_llama_imatrix_s(tmp_path: Path) -> None:
    """Key order and types, n_dims without trailing 1s, offsets 32-aligned, read raw."""
    single = MatrixStats(np.ones((1, 3), np.float32), np.array([2], np.int64))
    write_imatrix(tmp_path / "m.gguf", ImportanceMatrix({"x": single}, 512, 0, ()))
    raw = (tmp_path / "m.gguf").read_bytes()
    assert raw[:24] == b"GGUF" + struct.pack("<IQQ", 3, 2, 4)
    pos = 24
    keys = []
    for _ in range(4):
        (n,) = struct.unpack_from("<Q", raw, pos)
        key = raw[pos + 8 : pos + 8 + n].decode()
        (vtype,) = struct.unpack_from("<I", raw, pos + 8 + n)
        keys.append((key, vtype))
        pos += 8 + n + 4
        if vtype == 8:
            pos += 8 + struct.unpack_from("<Q", raw, pos)[0]
        elif vtype == 9:
            assert struct.unpack_from("<IQ", raw, pos) == (8, 0)  # an empty string array
            pos += 12
        else:
            pos += 4
    assert keys == [("general.type", 8), ("imatrix.datasets", 9), ("imatrix.chunk_count", 4),
                    ("imatrix.chunk_size", 4)]  # fmt: skip
    n = struct.unpack_from("<Q", raw, pos)[0]
    assert raw[pos + 8 : pos + 8 + n] == b"x.in_sum2"
    assert struct.unpack_from("<IQIQ", raw, pos + 8 + n) == (1, 3, 0, 0)  # 1 dim: [3], F32, @0
    assert len(raw) % 32 == 0
    assert raw[-32:-28] == struct.pack("<f", 2.0)  # the count, alone in its aligned slot


def test_the_block_count_is_bounded() -> None:
    """The name map costs work per block: a count from a hostile config is refused up front."""
    pytest.importorskip("gguf")
    one = MatrixStats(np.ones((1, 4), np.float32), np.ones(1, np.int64))
    m = ImportanceMatrix({"blk.0.attn_q.weight": one}, 512, 0)
    with pytest.raises(ValueError, match="llama.cpp loads models of 0 to 512"):
        hf_names_of(m, "llama", 10**9, smollm2_hf_names(1))
