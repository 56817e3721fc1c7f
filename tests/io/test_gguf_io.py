"""The GGUF file layer: reads what gguf-py writes, writes what gguf-py reads (byte-identical to
its GGUFWriter), round-trips, and refuses every file of the hostile corpus clearly."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qtool.errors import InputError
from qtool.gguf_types import GGML_TYPES, ValueType
from qtool.io import gguf_header
from qtool.io.gguf_file import GGUFFile
from qtool.io.gguf_header import parse_header
from qtool.io.gguf_layout import GGUFValue
from qtool.io.gguf_write import GGUFStreamWriter, build_header, write_gguf
from qtool.numerics import gguf as G
from tests.corpus_gguf import CASES, GGUFCase

gguf = pytest.importorskip("gguf")

Q = gguf.GGMLQuantizationType


def _reference_file(path: Path) -> dict[str, np.ndarray]:
    """A small llama-like GGUF written by gguf-py; returns its tensors (torch order)."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_name("tiny ü")
    w.add_token_list(["<s>", "a", "ü", ""])
    w.add_token_scores([0.0, -1.0, 2.5, 0.0])
    w.add_array("x.bools", [True, False])
    w.add_array("x.empty", [])
    w.add_float64("x.f64", 1.5)
    w.add_int8("x.i8", -3)
    w.add_uint64("x.u64", 2**60)
    w.add_bool("x.b", True)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    tensors = {
        "token_embd.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "blk.0.attn_norm.weight": np.ones(64, dtype=np.float16),
        "blk.0.ffn_down.weight": G.quantize(x, "Q4_K").numpy(),
        "blk.0.ffn_up.weight": G.quantize(x, "Q8_0").numpy(),
    }
    for name, arr in tensors.items():
        raw = None if arr.dtype != np.uint8 else (Q.Q4_K if "down" in name else Q.Q8_0)
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def _values_equal(ours: GGUFValue, field: object) -> bool:
    types = [ValueType(int(t)) for t in field.types]  # type: ignore[attr-defined]
    if types[0] is not ours.type or (len(types) > 1 and types[1] is not ours.item_type):
        return False
    theirs = field.contents()  # type: ignore[attr-defined]
    if isinstance(ours.value, np.ndarray):
        return bool(ours.value.tolist() == list(theirs))
    if isinstance(ours.value, tuple):
        return list(ours.value) == theirs
    return bool(ours.value == theirs)


def test_reads_what_gguf_py_writes(tmp_path: Path) -> None:
    tensors = _reference_file(tmp_path / "m.gguf")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    with GGUFFile(tmp_path / "m.gguf") as f:
        meta = f.header.metadata
        assert list(meta) == [k for k in reader.fields if not k.startswith("GGUF.")]
        assert all(_values_equal(meta[k], reader.fields[k]) for k in meta)
        assert [t.name for t in f.header.tensors] == [t.name for t in reader.tensors]
        for info, theirs in zip(f.header.tensors, reader.tensors, strict=True):
            assert info.type.id == int(theirs.tensor_type)
            assert list(info.shape) == theirs.shape.tolist()
            assert f.header.data_start + info.offset == theirs.data_offset
            assert info.nbytes == theirs.n_bytes
            assert np.array_equal(f.tensor_array(info), tensors[info.name])
            assert f.tensor_bytes(info).tobytes() == theirs.data.tobytes()


def test_writes_byte_identical_to_gguf_py_and_is_read_back(tmp_path: Path) -> None:
    _reference_file(tmp_path / "a.gguf")
    with GGUFFile(tmp_path / "a.gguf") as f:
        specs = [(t.name, t.type, t.shape) for t in f.header.tensors]
        datas = (f.tensor_bytes(t) for t in f.header.tensors)
        write_gguf(tmp_path / "b.gguf", f.header.metadata, specs, datas)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["a.gguf", "b.gguf"]  # no temp file left


_VALUES = {
    ValueType.UINT8: st.integers(0, 255),
    ValueType.INT8: st.integers(-128, 127),
    ValueType.UINT16: st.integers(0, 2**16 - 1),
    ValueType.INT32: st.integers(-(2**31), 2**31 - 1),
    ValueType.UINT64: st.integers(0, 2**64 - 1),
    ValueType.INT64: st.integers(-(2**63), 2**63 - 1),
    ValueType.FLOAT32: st.floats(width=32, allow_nan=False),
    ValueType.FLOAT64: st.floats(allow_nan=False),
    ValueType.BOOL: st.booleans(),
    ValueType.STRING: st.text(max_size=20),
}
_KEY = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)


@st.composite
def _metadata(draw: st.DrawFn) -> dict[str, GGUFValue]:
    out: dict[str, GGUFValue] = {}
    for key in draw(st.lists(_KEY, max_size=6, unique=True)):
        vtype = draw(st.sampled_from(list(_VALUES)))
        if draw(st.booleans()):
            items = draw(st.lists(_VALUES[vtype], max_size=5))
            # object arrays keep Python ints exact (2**64 - 1 is not a float)
            value = tuple(items) if vtype is ValueType.STRING else np.array(items, dtype=object)
            out[key] = GGUFValue(ValueType.ARRAY, value, vtype)
        else:
            out[key] = GGUFValue(vtype, draw(_VALUES[vtype]))
    return out


_SPEC = st.tuples(
    st.sampled_from(["F32", "F16", "BF16", "Q8_0", "Q4_K", "Q6_K", "I8", "IQ2_XXS"]),
    st.lists(st.integers(0, 3), min_size=0, max_size=3),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(meta=_metadata(), specs=st.lists(_SPEC, max_size=4), align_pow=st.integers(0, 7))
def test_round_trip_through_both_readers(
    tmp_path: Path, meta: dict[str, GGUFValue], specs: list, align_pow: int
) -> None:
    meta.pop("general.alignment", None)
    meta["general.alignment"] = GGUFValue(ValueType.UINT32, 1 << align_pow)
    rng = np.random.default_rng(0)
    shaped = [
        (f"t{i}", t, [GGML_TYPES[t].block_size * (1 + dims[0] if dims else 1), *dims[1:]])
        for i, (t, dims) in enumerate(specs)
    ]
    header, layout = build_header(meta, shaped)
    datas = [rng.integers(0, 256, t.nbytes, dtype=np.uint8) for t in layout.tensors]
    path = tmp_path / "r.gguf"
    path.unlink(missing_ok=True)
    write_gguf(path, meta, shaped, datas)
    with GGUFFile(path) as f:
        assert f.header.tensors == layout.tensors
        assert f.header.alignment == 1 << align_pow
        for info, data in zip(f.header.tensors, datas, strict=True):
            assert np.array_equal(f.tensor_bytes(info), data)
        for key, value in meta.items():
            got = f.header.metadata[key]
            assert (got.type, got.item_type) == (value.type, value.item_type)
            if value.type is ValueType.ARRAY and value.item_type is not ValueType.STRING:
                want = np.asarray(value.value).astype(got.value.dtype)  # type: ignore[union-attr]
                assert np.array_equal(got.value, want)  # type: ignore[arg-type]
            elif value.type is ValueType.FLOAT32:
                assert got.value == np.float32(value.value)  # type: ignore[arg-type]
            else:
                assert got.value == value.value
    reader = gguf.GGUFReader(path)
    assert [t.name for t in reader.tensors] == [t.name for t in layout.tensors]
    assert all(_values_equal(f.header.metadata[k], reader.fields[k]) for k in meta)
    assert len(header) == layout.data_start


def test_stream_writer_checks_sizes_and_completeness(tmp_path: Path) -> None:
    header, layout = build_header({}, [("a", "F32", [4]), ("b", "Q8_0", [32, 2])])
    with open(tmp_path / "x", "wb") as handle:
        writer = GGUFStreamWriter(handle, header, layout)
        with pytest.raises(ValueError, match="'a': 8 bytes given, 16 due"):
            writer.write(bytes(8))
        writer.write(np.zeros(4, dtype=np.float32))
        with pytest.raises(ValueError, match="'b' was not written"):
            writer.finish()
        writer.write(bytes(68))
        writer.finish()
        with pytest.raises(ValueError, match="already written"):
            writer.write(b"")
    assert parse_header(memoryview((tmp_path / "x").read_bytes())).tensors == layout.tensors


@pytest.mark.parametrize(
    ("meta", "specs", "message"),
    [
        ({}, [("a", "F32", [4]), ("a", "F32", [4])], "duplicate"),
        ({}, [("n" * 64, "F32", [4])], "over 63 bytes"),
        ({}, [("a", "Q4_K", [100])], "not whole Q4_K blocks"),
        ({}, [("a", "F32", [1, 1, 1, 1, 1])], "not one ggml can hold"),
        ({"general.alignment": GGUFValue(ValueType.UINT32, 48)}, [], "power of 2"),
        ({"general.alignment": GGUFValue(ValueType.UINT64, 32)}, [], "power of 2"),
        ({"k": GGUFValue(ValueType.UINT8, 256)}, [], "'k': UINT8 value 256"),
        ({"k": GGUFValue(ValueType.STRING, "\udc80")}, [], "surrogates not allowed"),
        ({"k": GGUFValue(ValueType.ARRAY, np.array([300]), ValueType.UINT8)}, [], "fit UINT8"),
        ({"k": GGUFValue(ValueType.ARRAY, (("a",),), ValueType.ARRAY)}, [], "other than ARRAY"),
        ({"": GGUFValue(ValueType.UINT8, 1)}, [], "key is empty"),
    ],
)
def test_build_header_refuses_what_ggml_would(meta: dict, specs: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_header(meta, specs)


def test_a_failed_write_leaves_no_file(tmp_path: Path) -> None:
    def datas():  # type: ignore[no-untyped-def]
        yield bytes(16)
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_gguf(tmp_path / "o.gguf", {}, [("a", "F32", [4]), ("b", "F32", [4])], datas())
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_files_are_refused_clearly(tmp_path: Path, case: GGUFCase) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(case.content)
    tracemalloc.start()
    try:
        with pytest.raises(InputError) as err:
            GGUFFile(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(err.value).startswith(f"{path}: not a valid GGUF file: ")
    assert case.expect in str(err.value)
    assert peak < 1 << 20  # nothing allocated from a declared size
    assert path.read_bytes() == case.content


def test_string_arrays_are_capped_in_total(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_header, "MAX_STRINGS", 5)
    tokens = GGUFValue(ValueType.ARRAY, ("a", "b", "c"), ValueType.STRING)
    write_gguf(tmp_path / "t.gguf", {"x": tokens, "y": tokens}, [], [])
    with pytest.raises(InputError, match="more than 5 strings in arrays"):
        GGUFFile(tmp_path / "t.gguf")


def test_special_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not a regular file"):
        GGUFFile(tmp_path)
    with pytest.raises(InputError, match="no such file"):
        GGUFFile(tmp_path / "missing.gguf")


def test_views_outlive_close_and_are_read_only(tmp_path: Path) -> None:
    _reference_file(tmp_path / "m.gguf")
    f = GGUFFile(tmp_path / "m.gguf")
    view = f.tensor_array(f.header.tensors[0])
    f.close()
    assert view.tolist() == np.arange(12).reshape(3, 4).tolist()
    with pytest.raises(ValueError, match="read-only"):
        view[0, 0] = 1


def test_gguf_py_custom_alignment_is_read(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(tmp_path / "a.gguf", "llama")
    w.add_custom_alignment(64)
    w.add_tensor("a", np.ones(3, dtype=np.float32))
    w.add_tensor("b", np.arange(5, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(tmp_path / "a.gguf") as f:
        assert f.header.alignment == 64
        assert f.header.data_start % 64 == 0
        assert [t.offset for t in f.header.tensors] == [0, 64]
        assert f.tensor_array(f.header.tensors[1]).tolist() == [0, 1, 2, 3, 4]


def test_big_endian_gguf_is_refused_clearly(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(tmp_path / "be.gguf", "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_tensor("a", np.ones(3, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InputError, match="big-endian GGUF file"):
        GGUFFile(tmp_path / "be.gguf")
