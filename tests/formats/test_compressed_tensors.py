"""compressed-tensors format: packing, tensor selection, group checks, config JSON, encode and
decode, and the reader's scheme resolution. No third-party loader needed (see test_interop.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from qtool.dtypes import DTYPES
from qtool.engine.plan import QuantizeOptions, plan_tensors
from qtool.errors import InputError
from qtool.formats.compressed_tensors import config as ctc
from qtool.formats.compressed_tensors import groups as ctg
from qtool.formats.compressed_tensors import loaders, schemes
from qtool.formats.compressed_tensors import selection as ct
from qtool.formats.compressed_tensors.codec import (
    dequantize_module,
    dequantize_named,
    encode_weight,
    fp16_underflow_warning,
    kernel_dequantized,
    unpack_bits,
)
from qtool.formats.detect import detect
from qtool.io.stformat import TensorEntry
from qtool.numerics.packing import pack_to_int32
from qtool.spec import (
    GroupFallback,
    PerChannel,
    PerGroup,
    PerTensor,
    QSpec,
    RangeMethod,
    Scheme,
    StorageDtype,
)


def select_tensors(
    entries: list[TensorEntry] | tuple[TensorEntry, ...],
    config: dict[str, object],
    spec: QSpec,
    include: tuple[str, ...] | list[str] = (),
    exclude: tuple[str, ...] | list[str] = (),
) -> list[ct.Selection]:
    """The export's selection over the planner's rules, as `qtool quantize --format
    compressed-tensors --include/--exclude` makes it."""
    options = QuantizeOptions(spec, tuple(include), tuple(exclude))
    return ct.select_planned(plan_tensors(Path("m.safetensors"), tuple(entries), options), config)


INT8_CH = QSpec(Scheme.SYM, StorageDtype.INT8, PerChannel(0))
INT4_G128 = QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(128))


def entry(name: str, shape: tuple[int, ...], dtype: str = "BF16") -> TensorEntry:
    return TensorEntry(name, dtype, shape, 0, 0)


# ---------------------------------------------------------------- packing golden vectors


def words(*values: int) -> list[int]:
    """uint32 bit patterns as the int32 values torch holds."""
    return [v - (1 << 32) if v >= 1 << 31 else v for v in values]


@pytest.mark.parametrize(
    ("codes", "bits", "expected"),
    [
        ([1, 2], 8, [33409]),  # u = [129, 130]: 129 + 130 * 256
        ([-128, -1, 0, 127], 8, words(0xFF807F00)),  # u = [0, 127, 128, 255]
        ([-8, -1, 0, 7, 1, 2, -3, 3], 4, words(0xB5A9F870)),  # u = [0,7,8,15,9,10,5,11]
        ([1, 2], 4, [169]),  # 9 + 10 * 16, padding nibbles 0
        ([0] * 9, 4, words(0x88888888, 0x8)),
    ],
    ids=["8bit-1-2", "8bit-extremes", "4bit-by-hand", "4bit-short", "4bit-nine-zeros"],
)
def test_golden_words(codes: list[int], bits: int, expected: list[int]) -> None:
    q = torch.tensor([codes], dtype=torch.int8)
    assert pack_to_int32(q, bits).tolist() == [expected]
    assert unpack_bits(torch.tensor([expected], dtype=torch.int32), bits, len(codes)).tolist() == [
        codes
    ]


def test_golden_zero_point_column_packs_along_dim_zero() -> None:
    column = torch.tensor([[-8], [-1], [0], [7], [1], [2], [-3], [3]], dtype=torch.int8)
    packed = pack_to_int32(column, 4, dim=0)
    assert packed.shape == (1, 1) and packed.tolist() == [words(0xB5A9F870)]
    zp8 = torch.tensor([[1, 5], [2, 6], [3, 7], [4, 8]], dtype=torch.int8)
    assert pack_to_int32(zp8, 8, dim=0).tolist() == [words(0x84838281, 0x88878685)]
    assert torch.equal(unpack_bits(pack_to_int32(zp8, 8, dim=0), 8, 4, dim=0), zp8)


def test_golden_three_bit_codes_straddle_words() -> None:
    codes = [v for _ in range(4) for v in range(-4, 4)]  # 32 codes, 96 bits
    packed = torch.tensor([words(0x88FAC688, 0xC688FAC6, 0xFAC688FA)], dtype=torch.int32)
    assert unpack_bits(packed, 3, 32).tolist() == [codes]


def reference_pack(codes: list[int], bits: int) -> list[int]:
    """A bit stream built one bit at a time: the definition, not an implementation."""
    stream = [((c + (1 << (bits - 1))) >> b) & 1 for c in codes for b in range(bits)]
    stream += [0] * (-len(stream) % 32)
    out = [
        sum(bit << i for i, bit in enumerate(stream[w : w + 32])) for w in range(0, len(stream), 32)
    ]
    return words(*out)


@given(st.integers(2, 8), st.integers(1, 70), st.data())
def test_unpack_any_width_inverts_the_bit_stream(bits: int, n: int, data: st.DataObject) -> None:
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))
    packed = torch.tensor([reference_pack(codes, bits)], dtype=torch.int32)
    assert unpack_bits(packed, bits, n).tolist() == [codes]
    if bits in (2, 4, 8):
        assert (
            pack_to_int32(torch.tensor([codes], dtype=torch.int8), bits).tolist() == packed.tolist()
        )


def test_unpack_refuses_a_width_that_does_not_fit() -> None:
    with pytest.raises(ValueError, match="pack into 2 words, got 1"):
        unpack_bits(torch.zeros(1, 1, dtype=torch.int32), 4, 9)


# ---------------------------------------------------------------- which tensors


LLAMA_CONFIG = {"model_type": "llama", "vocab_size": 256, "tie_word_embeddings": False}
LLAMA_LAYER = [
    entry(f"model.layers.0.self_attn.{p}.weight", s)
    for p, s in [
        ("q_proj", (256, 256)),
        ("k_proj", (128, 256)),
        ("v_proj", (128, 256)),
        ("o_proj", (256, 256)),
    ]
] + [
    entry(f"model.layers.0.mlp.{p}.weight", s)
    for p, s in [("gate_proj", (512, 256)), ("up_proj", (512, 256)), ("down_proj", (256, 512))]
]
LLAMA = [
    entry("model.embed_tokens.weight", (256, 256)),
    *LLAMA_LAYER,
    entry("model.layers.0.input_layernorm.weight", (256,)),
    entry("model.layers.0.post_attention_layernorm.weight", (256,)),
    entry("model.norm.weight", (256,)),
    entry("lm_head.weight", (256, 256)),
]


def fates(selections: list[ct.Selection]) -> dict[str, str]:
    return {s.entry.name: "q" if s.quantized else s.reason for s in selections}


def test_llama_quantizes_every_projection_and_ignores_the_head() -> None:
    sel = select_tensors(LLAMA, LLAMA_CONFIG, INT8_CH)
    assert fates(sel) == {
        "model.embed_tokens.weight": "embedding",
        **{e.name: "q" for e in LLAMA_LAYER},
        "model.layers.0.input_layernorm.weight": "1-D (bias/norm)",
        "model.layers.0.post_attention_layernorm.weight": "1-D (bias/norm)",
        "model.norm.weight": "1-D (bias/norm)",
        "lm_head.weight": "output head (lm_head)",
    }
    assert ct.ignore_list(sel) == ["lm_head"]
    assert ct.fused_inconsistencies(sel) == []


def test_llama_tied_head_stays_float_even_when_included() -> None:
    tied = {**LLAMA_CONFIG, "tie_word_embeddings": True}
    sel = select_tensors(LLAMA, tied, INT8_CH, include=["*"])
    assert fates(sel)["lm_head.weight"] == "output head tied to the input embeddings"
    untied = select_tensors(LLAMA, LLAMA_CONFIG, INT8_CH, include=["*"])
    assert fates(untied)["lm_head.weight"] == "q" and ct.ignore_list(untied) == []


BERT_CONFIG = {"model_type": "bert", "vocab_size": 256}  # tie_word_embeddings defaults to true
BERT = [
    entry("embeddings.word_embeddings.weight", (256, 128), "F32"),
    entry("embeddings.position_embeddings.weight", (64, 128), "F32"),
    entry("embeddings.token_type_embeddings.weight", (2, 128), "F32"),
    entry("embeddings.position_ids", (1, 64), "I64"),
    entry("embeddings.LayerNorm.weight", (128,), "F32"),
    entry("encoder.layer.0.attention.self.query.weight", (128, 128), "F32"),
    entry("encoder.layer.0.attention.self.query.bias", (128,), "F32"),
    entry("encoder.layer.0.intermediate.dense.weight", (256, 128), "F32"),  # same shape as vocab
    entry("pooler.dense.weight", (128, 128), "F32"),
    entry("cls.predictions.decoder.weight", (256, 128), "F32"),
]


def test_bert_keeps_embeddings_and_the_tied_decoder() -> None:
    sel = select_tensors(BERT, BERT_CONFIG, INT8_CH)
    assert fates(sel) == {
        "embeddings.word_embeddings.weight": "embedding",
        "embeddings.position_embeddings.weight": "embedding",
        "embeddings.token_type_embeddings.weight": "embedding",
        "embeddings.position_ids": "integer tensor",
        "embeddings.LayerNorm.weight": "1-D (bias/norm)",
        "encoder.layer.0.attention.self.query.weight": "q",
        "encoder.layer.0.attention.self.query.bias": "1-D (bias/norm)",
        "encoder.layer.0.intermediate.dense.weight": "q",
        "pooler.dense.weight": "q",
        "cls.predictions.decoder.weight": "output head tied to the input embeddings",
    }
    assert ct.ignore_list(sel) == ["cls.predictions.decoder"]


def test_gpt2_conv1d_projections_are_not_linear_layers() -> None:
    names = [("transformer.wte.weight", (50, 16)), ("transformer.wpe.weight", (8, 16))]
    names += [(f"transformer.h.0.{p}.weight", (16, 48)) for p in ("attn.c_attn", "mlp.c_fc")]
    sel = select_tensors([entry(n, s) for n, s in names], {"model_type": "gpt2"}, INT8_CH)
    assert [s.reason for s in sel] == ["embedding", "embedding"] + [
        "Conv1D (GPT-2 style, transposed weight): not an nn.Linear"
    ] * 2
    assert ct.ignore_list(sel) == []


MOE = [
    entry("model.layers.0.mlp.gate.weight", (8, 64)),
    entry("model.layers.0.mlp.experts.0.gate_proj.weight", (128, 64)),
    entry("model.layers.0.mlp.experts.0.up_proj.weight", (128, 64)),
    entry("model.layers.0.mlp.shared_expert.down_proj.weight", (64, 128)),
    entry("model.layers.0.mlp.shared_expert_gate.weight", (1, 64)),
    entry("model.layers.1.mlp.router.proj.weight", (8, 64)),
    entry("model.layers.2.mlp.experts.gate_up_proj", (8, 256, 64)),
    entry("model.vision.patch_embed.proj.weight", (64, 3, 14, 14)),
]


def test_moe_routers_stay_float_and_are_ignored() -> None:
    sel = select_tensors(MOE, {"model_type": "qwen2_moe"}, INT8_CH)
    assert [s.reason or "q" for s in sel] == [
        "MoE router/gate",
        "q",
        "q",
        "q",
        "MoE router/gate",
        "MoE router/gate",
        "3-D (fused MoE experts): not a Linear weight",
        "4-D (conv weight)",
    ]
    assert ct.ignore_list(sel) == [
        "model.layers.0.mlp.gate",
        "model.layers.0.mlp.shared_expert_gate",
        "model.layers.1.mlp.router.proj",
    ]


def test_globs_override_defaults_but_never_make_a_non_linear_quantized() -> None:
    sel = select_tensors(
        LLAMA,
        LLAMA_CONFIG,
        INT8_CH,
        include=["lm_head.weight", "model.embed_tokens.weight", "*.mlp.*"],
        exclude=["*.down_proj.weight"],
    )
    got = fates(sel)
    assert got["lm_head.weight"] == "q"
    # --include named it: the reason says why the format keeps it all the same
    assert got["model.embed_tokens.weight"] == (
        "embedding: compressed-tensors quantizes nn.Linear weights only (transformers and vLLM "
        "load no quantized embedding from it; the qtool and GGUF formats quantize embeddings)"
    )
    assert (
        got["model.layers.0.mlp.down_proj.weight"] == "excluded by --exclude '*.down_proj.weight'"
    )
    assert got["model.layers.0.self_attn.q_proj.weight"] == "not matched by --include"
    assert "model.layers.0.mlp.down_proj" in ct.ignore_list(sel)
    assert "model.layers.0.self_attn.o_proj" in ct.ignore_list(sel)


@pytest.mark.parametrize("dtype", [StorageDtype.UINT8, StorageDtype.UINT4], ids=lambda d: d.value)
def test_unsigned_codes_are_refused(dtype: StorageDtype) -> None:
    with pytest.raises(ValueError, match="signed codes: use int8 or int4"):
        select_tensors(LLAMA, LLAMA_CONFIG, QSpec(dtype=dtype))


def test_fused_siblings_must_be_treated_alike() -> None:
    sel = select_tensors(LLAMA, LLAMA_CONFIG, INT8_CH, exclude=["*.k_proj.weight"])
    assert ct.fused_inconsistencies(sel) == [
        "model.layers.0.self_attn.{q_proj,k_proj,v_proj} differ "
        "(q_proj: sym int8 axis 0, k_proj: float, v_proj: sym int8 axis 0)"
    ]
    up = next(i for i, s in enumerate(sel) if s.entry.name.endswith("up_proj.weight"))
    sel[up] = replace(sel[up], spec=INT4_G128)
    assert len(ct.fused_inconsistencies(sel)) == 2


# ---------------------------------------------------------------- groups


def group_plan(spec: QSpec) -> list[ct.Selection]:
    tensors = [
        entry("a.weight", (16, 256)),
        entry("b.weight", (16, 96)),
        entry("c.weight", (16, 100)),
    ]
    return select_tensors(tensors, {}, spec)


def test_group_violations_name_every_tensor() -> None:
    plan = group_plan(QSpec(granularity=PerGroup(64)))
    assert [v.describe() for v in ctg.group_violations(plan)] == [
        "b.weight (K=96, G=64)",
        "c.weight (K=100, G=64)",
    ]
    with pytest.raises(InputError, match=r"b.weight \(K=96, G=64\), c.weight \(K=100") as err:
        ctg.resolve_groups(plan, GroupFallback.ERROR)
    assert err.value.hints == ("group-fallback",)


def test_group_refusal_names_a_few_and_counts_the_rest() -> None:
    tensors = [entry(f"layers.{i}.weight", (16, 96)) for i in range(40)]
    plan = select_tensors(tensors, {}, QSpec(granularity=PerGroup(64)))
    with pytest.raises(InputError) as err:
        ctg.resolve_groups(plan, GroupFallback.ERROR)
    message = str(err.value)
    assert "layers.2.weight (K=96, G=64) and 37 more" in message
    assert "layers.3.weight" not in message


def test_group_fallback_channel_and_keep() -> None:
    plan = group_plan(QSpec(granularity=PerGroup(64)))
    channel = ctg.resolve_groups(plan, GroupFallback.CHANNEL)
    assert [s.spec.granularity if s.spec else None for s in channel] == [
        PerGroup(64),
        PerChannel(0),
        PerChannel(0),
    ]
    assert channel[1].note == "K=96 not a multiple of 64"
    kept = ctg.resolve_groups(plan, GroupFallback.KEEP)
    assert [s.quantized for s in kept] == [True, False, False]
    assert ct.ignore_list(kept) == ["b", "c"]
    assert ctg.resolve_groups(group_plan(QSpec(granularity=PerGroup(4))), GroupFallback.ERROR)


# ---------------------------------------------------------------- config.json


def test_config_for_symmetric_int8_channel_is_exact() -> None:
    sel = select_tensors(LLAMA, LLAMA_CONFIG, INT8_CH)
    assert ctc.quantization_config(sel, "0.1.0") == {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "channel",
                    "group_size": None,
                    "dynamic": False,
                },
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "qtool": {"version": "0.1.0", "semantics": "qtool", "range_method": ["minmax"]},
    }


def test_config_mixed_schemes_put_exact_names_first_and_linear_last() -> None:
    spec = QSpec(Scheme.ASYM, StorageDtype.INT4, PerGroup(128), RangeMethod.MSE)
    plan = select_tensors(LLAMA, LLAMA_CONFIG, spec)
    plan = [
        replace(s, entry=replace(s.entry, shape=(256, 320))) if "down" in s.entry.name else s
        for s in plan
    ]
    plan = ctg.resolve_groups(plan, GroupFallback.CHANNEL)
    q = ctc.quantization_config(plan, "0.1.0", {"group": [1.0, 0.9]})
    groups = q["config_groups"]
    assert isinstance(groups, dict) and list(groups) == ["group_0", "group_1"]
    assert groups["group_0"]["targets"] == ["model.layers.0.mlp.down_proj"]
    assert groups["group_0"]["weights"]["strategy"] == "channel"
    assert groups["group_1"]["targets"] == ["Linear"]
    assert groups["group_1"]["weights"] == {
        "num_bits": 4,
        "type": "int",
        "symmetric": False,
        "strategy": "group",
        "group_size": 128,
        "dynamic": False,
    }
    assert q["qtool"] == {
        "version": "0.1.0",
        "semantics": "qtool",
        "range_method": ["mse"],
        "mse_algorithm": "qtool-mse-v1",
        "mse_candidates": {"group": [1.0, 0.9]},
    }
    assert any("several schemes" in w for w in loaders.export_warnings(plan))


def test_per_tensor_is_written_as_channel() -> None:
    spec = QSpec(granularity=PerTensor())
    assert ctc.weights_args(spec)["strategy"] == "channel"
    sel = select_tensors([entry("a.weight", (9, 32))], {}, spec)
    assert ct.output_tensors(sel[0])["a.weight_scale"] == ("BF16", (9, 1))


def test_existing_quantization_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="already quantized"):
        ctc.with_quantization_config({"quantization_config": {"x": 1}}, {}, tmp_path)
    assert ctc.with_quantization_config({"a": 1}, {"b": 2}, tmp_path) == {
        "a": 1,
        "quantization_config": {"b": 2},
    }


def test_warnings() -> None:
    asym8 = select_tensors(
        [entry("a.weight", (9, 96))], {}, QSpec(Scheme.ASYM, granularity=PerGroup(48))
    )
    got = loaders.export_warnings(asym8)
    assert any(w.startswith("asymmetric int8 runs on few vLLM kernels") for w in got)
    assert any(w.startswith("group size 48:") for w in got)
    assert not any("dequantize" in w for w in got)  # one scheme: the export dequantizes
    assert any('"dequantize"' in w for w in loaders.export_warnings(asym8, dequantize=True))
    assert loaders.export_warnings(select_tensors([entry("a.weight", (9, 96))], {}, INT8_CH)) == []
    tiny = torch.tensor([[1e-6], [1.0]], dtype=torch.float16)
    assert fp16_underflow_warning("a.weight", tiny) == (
        "a.weight: 1 of 2 float16 scales are subnormal (< 6.1e-05) and lose precision; "
        "quantize a bfloat16/float32 copy or exclude the tensor"
    )
    assert fp16_underflow_warning("a.weight", tiny.bfloat16()) is None


# ---------------------------------------------------------------- encode / decode


SCHEMES = [
    QSpec(scheme, dtype, granularity)
    for scheme in Scheme
    for dtype in ct.SUPPORTED_DTYPES
    for granularity in (PerChannel(0), PerGroup(16), PerTensor())
]


@pytest.mark.parametrize("spec", SCHEMES, ids=lambda s: s.describe().replace(" ", "-"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_encode_decode_matches_the_kernels_bit_for_bit(spec: QSpec, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w = (torch.randn(9, 48) * torch.rand(9, 1)).to(dtype)  # N = 9: one code row past a word
    encoded = encode_weight(w, spec)
    st_dtype = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dtype]
    planned = ct.output_tensors(ct.Selection(entry("m.weight", (9, 48), st_dtype), "m", spec))
    assert list(planned) == [f"m.{local}" for local in encoded.tensors]
    for local, t in encoded.tensors.items():
        want_dtype, want_shape = planned[f"m.{local}"]
        assert (str(t.dtype), tuple(t.shape)) == (
            f"torch.{DTYPES[want_dtype].torch_name}",
            want_shape,
        )
        assert t.is_contiguous(), local  # safetensors writes contiguous tensors only
    args = ctc.parse_args("g", ctc.weights_args(spec), "pack-quantized")
    decoded = dequantize_module(encoded.tensors, args, "pack-quantized")
    assert decoded.dtype == dtype
    assert torch.equal(decoded, kernel_dequantized(encoded, spec, (9, 48), dtype))


def test_encode_uses_the_full_signed_range_and_model_dtype_scales() -> None:
    # amax 7.5: scale 7.5 / 7.5 = 1, so -7.5 -> -8 (half to even) and 7.5 -> 8 -> clamped to 7
    w = torch.tensor([[-7.5, 3.0, 7.5, 0.0]], dtype=torch.bfloat16)
    enc = encode_weight(w, QSpec(Scheme.SYM, StorageDtype.INT4, PerChannel(0)))
    assert unpack_bits(enc.tensors["weight_packed"], 4, 4).tolist() == [[-8, 3, 7, 0]]
    assert enc.tensors["weight_scale"].dtype == torch.bfloat16
    # int8 keeps qtool's mirrored [-127, 127] with scale amax / 127
    w8 = torch.tensor([[-127.0, 64.0, 127.0, 0.0]], dtype=torch.bfloat16)
    enc8 = encode_weight(w8, INT8_CH)
    assert unpack_bits(enc8.tensors["weight_packed"], 8, 4).tolist() == [[-127, 64, 127, 0]]
    assert enc8.tensors["weight_scale"].tolist() == [[1.0]]


@pytest.mark.parametrize(
    ("weight", "spec", "match"),
    [
        (torch.zeros(4, 96), QSpec(granularity=PerGroup(64)), "does not divide K = 96"),
        (torch.zeros(4, 8, dtype=torch.float64), INT8_CH, "bf16/fp16/fp32"),
        (torch.zeros(4, 8, 2), INT8_CH, "2-D"),
        (torch.zeros(4, 8), QSpec(granularity=PerChannel(1)), "axis 0"),
    ],
    ids=["group", "float64", "3d", "axis1"],
)
def test_encode_refuses_what_compressed_tensors_cannot_hold(
    weight: torch.Tensor, spec: QSpec, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        encode_weight(weight, spec)


def test_decode_naive_quantized_and_tensor_asym_by_hand() -> None:
    scale = torch.tensor([[0.5], [2.0]], dtype=torch.bfloat16)
    q = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)
    zp = torch.tensor([[1], [-1]], dtype=torch.int8)
    asym = ctc.CtArgs(8, False, "channel")
    got = dequantize_module(
        {"weight": q, "weight_scale": scale, "weight_zero_point": zp}, asym, "naive-quantized"
    )
    assert got.tolist() == [[0.0, -1.5], [8.0, 10.0]] and got.dtype == torch.bfloat16
    # tensor strategy: the zero point is an unpacked int8 [1] (compressed-tensors packs only
    # channel/group zero points)
    tensor = ctc.CtArgs(4, False, "tensor")
    packed = pack_to_int32(q, 4)
    tensors = {
        "weight_packed": packed,
        "weight_scale": torch.tensor([0.25]),
        "weight_zero_point": torch.tensor([2], dtype=torch.int8),
        "weight_shape": torch.tensor([2, 2]),
    }
    assert dequantize_module(tensors, tensor, "pack-quantized").tolist() == [
        [-0.25, -1.0],
        [0.25, 0.5],
    ]


# ---------------------------------------------------------------- reading: config and schemes


def group(name: str, targets: list[str], bits: int = 8) -> dict[str, object]:
    return {
        "targets": targets,
        "weights": {"num_bits": bits, "strategy": "channel"},
        "format": "pack-quantized",
    }


def config(
    groups: dict[str, object], ignore: list[str] | None = None, **top: object
) -> dict[str, object]:
    return {
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore or [],
        **top,
    }


def test_resolution_exact_beats_regex_beats_class_and_ignore_wins() -> None:
    cfg = ctc.parse_config(
        config(
            {
                "g_class": group("g_class", ["Linear"], 4),
                "g_regex": group("g_regex", ["re:.*down_proj$"], 5),
                "g_exact": group("g_exact", ["model.layers.0.mlp.down_proj"], 6),
            },
            ignore=["re:.*lm_head$", "LayerNorm"],
        )
    )

    def bits(module: str) -> int | None:
        g = schemes.resolve(module, cfg)
        return g.weights.num_bits if g else None

    assert bits("model.layers.0.mlp.down_proj") == 6
    assert bits("model.layers.1.mlp.down_proj") == 5
    assert bits("model.layers.1.mlp.down_proj_extra") == 4  # `$` anchors the end
    assert bits("model.layers.1.self_attn.q_proj") == 4
    assert bits("lm_head") is None
    assert (
        schemes.target_matches("re:down_proj", "model.layers.0.mlp.down_proj") is None
    )  # re.match


def test_regexes_tie_break_alphabetically() -> None:
    cfg = ctc.parse_config(
        config({"a": group("a", ["re:.*proj$"], 4), "b": group("b", ["re:.*o_proj$"], 8)})
    )
    got = schemes.resolve("x.o_proj", cfg)
    assert got is not None and got.weights.num_bits == 8  # "re:.*o_proj$" < "re:.*proj$"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"quantization_status": "frozen"}, "compressed checkpoints only"),
        ({"sparsity_config": {"format": "sparse-24"}}, "sparsity"),
        ({"transform_config": {"config_groups": {}}}, "transforms"),
        (
            {"config_groups": {"g": {**group("g", ["Linear"]), "format": "float-quantized"}}},
            "'float-quantized'",
        ),
        (
            {
                "config_groups": {
                    "g": {**group("g", ["Linear"]), "input_activations": {"num_bits": 8}}
                }
            },
            "activation",
        ),
        (
            {
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"type": "float", "num_bits": 8},
                        "format": "pack-quantized",
                    }
                }
            },
            "fp8",
        ),
        (
            {
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"actorder": "group", "strategy": "group", "group_size": 8},
                        "format": "pack-quantized",
                    }
                }
            },
            "actorder",
        ),
        (
            {
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"strategy": "tensor_group", "group_size": 16},
                        "format": "pack-quantized",
                    }
                }
            },
            "'tensor_group'",
        ),
        (
            {
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 4},
                        "format": "naive-quantized",
                    }
                }
            },
            "int8 only",
        ),
    ],
    ids=[
        "status",
        "sparsity",
        "transform",
        "fp8-format",
        "activations",
        "float-type",
        "actorder",
        "strategy",
        "naive-4bit",
    ],
)
def test_unsupported_variants_are_named(change: dict[str, object], match: str) -> None:
    doc = {**config({"g": group("g", ["Linear"])}), **change}
    with pytest.raises(ValueError, match=match):
        ctc.parse_config(doc)


def test_int_quantized_weights_are_read_back_and_strategy_is_inferred() -> None:
    doc = config(
        {
            "g": {
                "targets": ["Linear"],
                "weights": {"group_size": -1},
                "input_activations": {"num_bits": 8, "dynamic": True},
                "format": "int-quantized",
            }
        }
    )
    assert ctc.parse_config(doc).groups[0].weights == ctc.CtArgs(8, True, "channel")


def test_detect_and_read_a_model_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": config({"g": group("g", ["Linear"])})})
    )
    save_file({"x.weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    for path in (tmp_path, tmp_path / "config.json"):
        found = detect(path)
        assert (found.format, found.directory, found.quantized) == (ct.FORMAT, tmp_path, True)
        assert ctc.read_config(found.config, path).groups[0].format == "pack-quantized"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "llama"}')
    save_file({"x.weight": torch.zeros(2, 2)}, tmp_path / "other" / "model.safetensors")
    assert detect(tmp_path / "other").format != ct.FORMAT
    with pytest.raises(InputError, match="no compressed-tensors quantization_config"):
        ctc.read_config({"model_type": "llama"}, tmp_path / "other" / "config.json")


def test_restore_plan_and_named_dequantization() -> None:
    cfg = ctc.parse_config(config({"g": group("g", ["Linear"])}, ignore=["lm_head"]))
    enc = encode_weight(torch.randn(9, 8), INT8_CH)
    stored = {f"layer.{k}": v for k, v in enc.tensors.items()}
    stored |= {"layer.bias": torch.zeros(9), "lm_head.weight": torch.ones(3, 8)}
    plan = schemes.restore_plan(stored, cfg)
    assert [name for name, _ in plan] == ["layer.weight", "layer.bias", "lm_head.weight"]
    module = plan[0][1]
    assert module is not None
    got = dequantize_named(module, stored.__getitem__, stored)
    assert torch.equal(got, kernel_dequantized(enc, INT8_CH, (9, 8), torch.float32))
    with pytest.raises(ValueError, match="no config group targets it"):
        schemes.quantized_modules(
            ["x.weight_packed"], ctc.parse_config(config({"g": group("g", ["y"])}))
        )
    with pytest.raises(ValueError, match="weight_g_idx"):
        schemes.quantized_modules(["x.weight_packed", "x.weight_g_idx"], cfg)


def test_planning_and_config_reading_do_not_import_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": config({"g": group("g", ["Linear"])})})
    )
    save_file({"a.weight_packed": torch.zeros(1, dtype=torch.int32)}, tmp_path / "m.safetensors")
    code = (
        "import sys\n"
        "from qtool.formats.compressed_tensors import config as ct_config, schemes\n"
        "from qtool.formats.compressed_tensors import selection as ct\n"
        "from qtool.formats.detect import detect\n"
        "from qtool.engine.plan import QuantizeOptions, plan_tensors\n"
        "from qtool.io.stformat import TensorEntry\n"
        "e = (TensorEntry('a.weight', 'BF16', (16, 64), 0, 0),)\n"
        "s = ct.select_planned(plan_tensors('m', e, QuantizeOptions()), {})\n"
        "ct_config.quantization_config(s, 'x'); ct.output_tensors(s[0])\n"
        "from pathlib import Path\n"
        f"found = detect(Path({str(tmp_path)!r}))\n"
        "cfg = ct_config.read_config(found.config, found.path)\n"
        "schemes.restore_plan(['a.weight_packed'], cfg)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("dtype", ["I64", "U8", "BOOL", "F8_E4M3"])
def test_both_formats_say_why_a_non_float_tensor_is_kept_in_the_same_words(dtype: str) -> None:
    """qtool's table said 'kept: integer tensor' where compressed-tensors' said 'kept: not a
    float tensor (I64)' for the same position_ids (issue 33 polish: two wordings)."""
    from qtool.recipe.rules import selection_reason

    ids = entry("embeddings.position_ids", (1, 512), dtype)
    sel = select_tensors([*BERT, ids], BERT_CONFIG, INT8_CH)
    assert fates(sel)["embeddings.position_ids"] == selection_reason(ids)
