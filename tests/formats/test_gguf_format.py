"""formats/gguf: the float reader, the inspect summary, llama-quantize's plan and the quantized
writer, on tiny GGUF files written with gguf-py (tests/gguf_models.py) or by hand."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from qtool.errors import InputError, NumericError
from qtool.formats.gguf import plan
from qtool.formats.gguf.ftype import FILE_TYPE_KEY, ftype_name, guess_ftype
from qtool.formats.gguf.inspect import inspect as gguf_inspect
from qtool.formats.gguf.reader import GGUFFloatReader
from qtool.formats.gguf.summary import summarize
from qtool.formats.gguf.writer import write_quantized
from qtool.gguf_types import GGML_TYPES, ValueType
from qtool.io.atomic import OutputSet
from qtool.io.gguf_file import GGUFFile
from qtool.io.gguf_layout import GGUFTensorInfo, GGUFValue
from qtool.io.gguf_write import write_gguf
from qtool.numerics import gguf as G
from qtool.report.json import inspect_json
from qtool.spec import gguf_spec
from tests import gguf_models as M

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama HF directory holding its F32 and BF16 GGUFs."""
    d = M.make_hf_llama(tmp_path_factory.mktemp("tiny"))
    M.write_float_gguf(d, d / "f32.gguf")
    M.write_float_gguf(d, d / "bf16.gguf", "BF16")
    return d


def _quantize(src: Path, out: Path, asked: object, **kw: object) -> list[object]:
    with GGUFFile(src) as f, OutputSet() as outputs:
        choices = plan.choose(f.header.tensors, asked, "llama")  # type: ignore[arg-type]
        written = write_quantized(f, choices, out, outputs, **kw)  # type: ignore[arg-type]
        outputs.commit()
    return written  # type: ignore[return-value]


# ---------------------------------------------------------------- reader and summary


def test_the_reader_gives_every_tensor_as_gguf_py_does(tiny: Path) -> None:
    out = tiny / "mixed.gguf"
    asked = {"blk.0.attn_q.weight": gguf_spec("Q4_K"), "blk.1.ffn_down.weight": gguf_spec("Q5_1")}
    _quantize(tiny / "bf16.gguf", out, asked)
    theirs = gguf.GGUFReader(out)
    with GGUFFloatReader(out) as r:
        assert r.names == [t.name for t in theirs.tensors]
        for t in theirs.tensors:
            ours = r.values(t.name)
            assert r.shape(t.name) == tuple(reversed(t.shape.tolist())) == tuple(ours.shape)
            assert r.stored_dtype(t.name) == t.tensor_type.name
            assert r.nbytes(t.name) == t.n_bytes
            if t.tensor_type.name == "BF16":
                ref = torch.from_numpy(np.array(t.data)).view(torch.bfloat16)
            else:
                ref = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
            assert torch.equal(ours, ref.reshape(ours.shape)), t.name
        assert r.quantization("blk.0.attn_q.weight") == gguf_spec("Q4_K")
        assert r.quantization("blk.0.attn_norm.weight") is None
        assert (r.dtype("blk.0.attn_q.weight"), r.dtype("blk.0.attn_k.weight")) == ("F32", "BF16")
        assert r.values("blk.0.attn_k.weight").dtype == torch.bfloat16
        assert r.values("blk.0.attn_q.weight", torch.float16).dtype == torch.float16
        assert (
            bytes(r.raw("blk.0.attn_norm.weight"))
            == np.array(
                theirs.tensors[
                    [t.name for t in theirs.tensors].index("blk.0.attn_norm.weight")
                ].data
            ).tobytes()
        )
        with pytest.raises(ValueError, match="Q4_K-quantized; read its values"):
            r.raw("blk.0.attn_q.weight")
        r.check_unchanged()


def test_types_qtool_has_no_kernel_for_are_read_through_gguf_py(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (4, GGML_TYPES["IQ4_NL"].type_size * 2), dtype=np.uint8)
    raw.reshape(4, 2, -1)[:, :, :2] = np.array([0.01], np.float16).view(np.uint8)  # scales
    write_gguf(tmp_path / "iq.gguf", {}, [("w", "IQ4_NL", [64, 4])], [raw])
    with GGUFFloatReader(tmp_path / "iq.gguf") as r:
        expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.IQ4_NL)
        assert np.array_equal(r.values("w").numpy(), expected)
        assert r.quantization("w") == gguf_spec("IQ4_NL")


def test_the_summary_shows_architecture_metadata_tensors_and_totals(tiny: Path) -> None:
    out = tiny / "q6.gguf"
    _quantize(tiny / "f32.gguf", out, lambda info: gguf_spec("Q6_K"))
    with GGUFFile(out) as f:
        s = summarize(str(out), f.header)
    assert (s.architecture, s.name, s.block_count, s.context_length) == (
        "llama",
        "tiny llama",
        2,
        128,
    )
    assert s.vocab_size == len(M.vocabulary()[0])
    assert (s.file_type, s.file_type_name) == (18, "Q6_K")
    row = next(r for r in s.rows if r.name == "blk.0.ffn_up.weight")
    assert (row.gguf_type, row.shape, row.numel) == ("Q6_K", (M.FF, M.HIDDEN), M.FF * M.HIDDEN)
    assert row.bits_per_weight == 6.5625
    totals = {t.dtype: t for t in s.totals}
    assert set(totals) == {"Q6_K", "F32"}
    assert totals["F32"].tensors == 2 * M.LAYERS + 1  # the norms
    assert sum(t.nbytes for t in s.totals) == s.total_bytes == sum(r.nbytes for r in s.rows)
    doc = inspect_json(gguf_inspect(out))  # what `qtool inspect --json` prints
    assert doc["metadata"]["file_type"] == "Q6_K" and doc["totals_by_type"][0]["dtype"] == "Q6_K"


def test_file_type_names_and_guesses_are_llama_cpps() -> None:
    assert ftype_name(15) == "Q4_K - Medium"
    assert ftype_name(15 | 1024) == "(guessed) Q4_K - Medium"
    assert ftype_name(99) == "unknown, may not work"
    assert guess_ftype(["Q4_K", "Q6_K", "Q6_K", "Q4_K"]) == 18  # first to reach the top count
    assert guess_ftype(["IQ4_NL"]) == 25 and guess_ftype([]) == 0


# ---------------------------------------------------------------- llama-quantize's plan


def _info(name: str, shape: list[int], t: str = "F16") -> GGUFTensorInfo:
    gt = GGML_TYPES[t]
    return GGUFTensorInfo(name, gt, tuple(shape), 0, 0)


@pytest.mark.parametrize(
    ("name", "shape", "why"),
    [
        ("blk.0.attn_norm.weight", [256], "1-D"),
        ("blk.0.attn_q.weight", [256, 1], "1-D"),  # ggml_n_dims ignores trailing 1s
        ("blk.0.attn_q.bias", [256, 4], "not a weight"),
        ("blk.0.ffn_gate_inp.weight", [256, 8], "an expert gate"),
        ("position_embd.weight", [256, 8], "a position embedding"),
        ("blk.0.ssm_conv1d.weight", [4, 256], "a small conv1d"),
        ("blk.0.time_mix_w1.weight", [256, 32], "a small RWKV weight"),
        ("blk.0.attn_q.weight", [256, 256], None),
        ("output.weight", [256, 300], None),
    ],
)
def test_what_llama_quantize_keeps(name: str, shape: list[int], why: str | None) -> None:
    found = plan.kept_by_llama(name, shape, "llama")
    assert (found is None) if why is None else (found is not None and found.startswith(why))


def test_choices_follow_llama_quantize_order_fallbacks_and_sources() -> None:
    infos = [
        _info("blk.10.ffn_up.weight", [256, 8]),
        _info("blk.2.ffn_up.weight", [576, 8]),  # 576: not whole Q4_K blocks -> Q5_0
        _info("token_embd.weight", [100, 8]),  # 100: not whole 32-blocks either -> F16
        _info("blk.2.attn_norm.weight", [576], "F32"),
        _info("output.weight", [256, 8], "Q8_0"),  # already quantized
        _info("blk.2.attn_k.weight", [256, 8]),
    ]
    choices = plan.choose(infos, lambda info: gguf_spec("Q4_K"), "llama")
    by = {c.info.name: c for c in choices}
    assert [c.info.name for c in choices] == [
        "output.weight", "token_embd.weight", "blk.2.attn_k.weight", "blk.2.attn_norm.weight",
        "blk.2.ffn_up.weight", "blk.10.ffn_up.weight",
    ]  # fmt: skip
    assert by["blk.2.ffn_up.weight"].stored.name == "Q5_0"
    assert "fallback: rows of 576 are not whole Q4_K blocks" in by["blk.2.ffn_up.weight"].note
    assert by["token_embd.weight"].stored.name == "F16" and not by["token_embd.weight"].quantized
    assert by["blk.2.attn_norm.weight"].spec is None
    assert by["output.weight"].reason.startswith("already Q8_0")
    assert by["blk.10.ffn_up.weight"].stored.name == "Q4_K"
    assert plan.file_type(choices, 1) == 15  # Q4_K twice, Q5_0 once
    assert plan.file_type([c for c in choices if not c.quantized], 1) == 1


# ---------------------------------------------------------------- the writer


def test_the_writer_carries_everything_over_as_llama_quantize_does(tiny: Path) -> None:
    src, out = tiny / "f32.gguf", tiny / "q4_0.gguf"
    written = _quantize(src, out, lambda info: gguf_spec("Q4_0"))
    with GGUFFile(src) as a, GGUFFile(out) as b:
        ma, mb = a.header.metadata, b.header.metadata
        assert list(mb)[-2:] == ["general.quantization_version", FILE_TYPE_KEY]
        assert [k for k in mb if k in ma] == [k for k in ma if k != FILE_TYPE_KEY] + [FILE_TYPE_KEY]
        assert (mb["general.quantization_version"].value, mb[FILE_TYPE_KEY].value) == (2, 2)
        assert mb["tokenizer.ggml.tokens"].value == ma["tokenizer.ggml.tokens"].value
        assert [t.name for t in b.header.tensors] == plan.llama_order(
            [t.name for t in a.header.tensors]
        )
        assert b.header.alignment == 32 and all(t.offset % 32 == 0 for t in b.header.tensors)
        for t in b.header.tensors:
            src_info = a.header.by_name()[t.name]
            x = torch.from_numpy(a.tensor_array(src_info).copy())
            if len(t.shape) == 1:
                assert t.type.name == "F32" and np.array_equal(
                    b.tensor_bytes(t), a.tensor_bytes(src_info)
                )
            else:
                assert t.type.name == "Q4_0"
                assert np.array_equal(b.tensor_bytes(t), G.quantize(x, "Q4_0").numpy().reshape(-1))
    errors = {w.name: w.errors for w in written}  # type: ignore[attr-defined]
    assert errors["blk.0.attn_norm.weight"] is None
    assert 10 < errors["blk.0.attn_q.weight"].sqnr_db < 30  # type: ignore[union-attr]


def test_nan_is_an_error_naming_the_tensor_or_kept_when_asked(tmp_path: Path) -> None:
    x = np.ones((4, 32), dtype=np.float32)
    x[1, 3] = np.nan
    meta = {"general.architecture": GGUFValue(ValueType.STRING, "llama")}
    write_gguf(tmp_path / "nan.gguf", meta, [("w.weight", "F32", [32, 4])], [x])
    with pytest.raises(NumericError, match=r"tensor 'w.weight': has 1 NaN/Inf values"):
        _quantize(tmp_path / "nan.gguf", tmp_path / "out.gguf", lambda i: gguf_spec("Q8_0"))
    assert sorted(os.listdir(tmp_path)) == ["nan.gguf"]  # nothing left behind
    written = _quantize(tmp_path / "nan.gguf", tmp_path / "out.gguf", lambda i: gguf_spec("Q8_0"),
                        keep_nonfinite=True)  # fmt: skip
    assert written[0].choice.reason == "1 NaN/Inf values: kept"  # type: ignore[attr-defined]
    with GGUFFile(tmp_path / "out.gguf") as f:
        assert f.header.tensors[0].type.name == "F32"
        assert FILE_TYPE_KEY in f.header.metadata  # the header's size was fixed before


def test_a_split_part_is_refused(tmp_path: Path) -> None:
    meta = {"split.count": GGUFValue(ValueType.UINT16, 3)}
    write_gguf(
        tmp_path / "part.gguf",
        meta,
        [("w.weight", "F32", [32, 2])],
        [np.zeros((2, 32), np.float32)],
    )
    with pytest.raises(InputError, match="part 1 of 3 of a split GGUF"):
        _quantize(tmp_path / "part.gguf", tmp_path / "out.gguf", lambda i: gguf_spec("Q8_0"))


def test_custom_alignment_is_kept(tmp_path: Path) -> None:
    meta = {"general.alignment": GGUFValue(ValueType.UINT32, 64)}
    datas = [np.ones((2, 32), np.float32), np.ones(3, np.float32), np.ones((2, 64), np.float32)]
    specs = [("a.weight", "F32", [32, 2]), ("b", "F32", [3]), ("c.weight", "F32", [64, 2])]
    write_gguf(tmp_path / "a.gguf", meta, specs, datas)
    _quantize(tmp_path / "a.gguf", tmp_path / "out.gguf", lambda i: gguf_spec("Q8_0"))
    theirs = gguf.GGUFReader(tmp_path / "out.gguf")
    assert theirs.alignment == 64
    assert [t.tensor_type.name for t in theirs.tensors] == ["Q8_0", "F32", "Q8_0"]
    assert all(t.data_offset % 64 == 0 for t in theirs.tensors)


def test_unplaced_tensors_are_listed_never_dropped(tiny: Path) -> None:
    from safetensors.torch import load_file

    from qtool.formats.gguf.names import TIED, hf_view

    hf = list(load_file(tiny / "model.safetensors"))
    hf.remove("model.layers.1.mlp.up_proj.weight")  # the GGUF has it, the HF side does not
    hf += ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.vision.weight"]
    with GGUFFloatReader(tiny / "f32.gguf") as r:
        view, pairing = hf_view(r, [*hf, "lm_head.weight"])
    assert pairing.gguf_unplaced == [
        ("blk.1.ffn_up.weight", "no tensor of the Hugging Face checkpoint maps to it")
    ]
    assert dict(pairing.hf_unplaced) == {
        "model.layers.0.self_attn.rotary_emb.inv_freq":
            "maps to blk.0.attn_rot_embd, which the GGUF file lacks",
        "model.vision.weight": "gguf's name map for llama has no GGUF name for it",
        "lm_head.weight": "maps to output.weight, which another tensor maps to already",
    }  # fmt: skip
    assert TIED not in {p.note for p in pairing.placed}  # the file has its own output.weight
