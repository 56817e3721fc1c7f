"""quantize HF_DIR --format gguf --dtype F16|BF16|F32: the float GGUF llama.cpp's
convert_hf_to_gguf.py --outtype f16|bf16|f32 writes, as the run's output (engine/hf_gguf.py
write_float). Every tensor's bytes are checked against gguf-py's own numpy conversion of the
checkpoint (gguf.quants.quantize, what the converter calls), for an F32 and a BF16 checkpoint
(and F16) of a tiny Llama and a tiny Qwen2 with biases; transformers loads each file back to the
checkpoint's logits. The real-model proof (byte-identical files on SmolLM2) is docs/gguf.md's."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from qtool.formats.gguf import hf_export, hf_vocab
from qtool.formats.gguf.hf_export import bf16_bits, cast, kept_f32
from tests.conftest import run_qtool
from tests.formats.gguf.hf_models import write_model
from tests.formats.gguf.test_hf_export import _Table

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

FILE_TYPES = {"F32": 0, "F16": 1, "BF16": 32}  # llama_ftype ALL_F32, MOSTLY_F16, MOSTLY_BF16


@pytest.fixture(autouse=True)
def known_pre_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_vocab, "PRE_TOKENIZERS", _Table(hf_vocab.PRE_TOKENIZERS))


def _model(tmp_path: Path, arch: str, dtype: torch.dtype) -> Path:
    src = write_model(tmp_path / "m", arch)
    if dtype is not torch.float32:
        state = safetensors_torch.load_file(src / "model.safetensors")
        state = {k: v.to(dtype) for k, v in state.items()}
        safetensors_torch.save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    return src


def _convert(src: Path, out: Path, kind: str, *extra: str) -> dict[str, object]:
    code, stdout, stderr = run_qtool("quantize", str(src), "--format", "gguf", "--dtype", kind,
                                     "-o", str(out), "--json", *extra)  # fmt: skip
    assert code == 0, stderr
    assert "warning" not in stderr, stderr  # "0 of N tensors selected" is no news here
    report: dict[str, object] = json.loads(stdout)
    return report


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as the converter writes it."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _expected(src: Path, arch: str, kind: str) -> dict[str, tuple[int, bytes]]:
    """What the converter writes for each GGUF name: its type and bytes, from gguf-py's numpy
    code (the checkpoint cast to float32 unless F16/F32, as prepare_tensors does)."""
    config = json.loads((src / "config.json").read_text())
    names = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2,
        config["num_hidden_layers"],
    )
    out = {}
    for name, t in safetensors_torch.load_file(src / "model.safetensors").items():
        if t.dtype not in (torch.float16, torch.float32):
            t = t.to(torch.float32)
        data = t.numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"]
            if "k_proj" in name:
                heads = config["num_key_value_heads"]
            data = _permute(data, heads)
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None
        keep = data.ndim <= 1 or new.endswith("_norm.weight") or not new.endswith(".weight")
        qtype = gguf.GGMLQuantizationType.F32 if keep else gguf.GGMLQuantizationType[kind]
        out[new] = (int(qtype), gguf.quants.quantize(data, qtype).tobytes())
    return out


@pytest.mark.parametrize("kind", ["F16", "BF16", "F32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_tensor_is_gguf_py_conversion_and_transformers_reads_it(
    tmp_path: Path, arch: str, dtype: torch.dtype, kind: str
) -> None:
    """The class of defect: a float type, a rounding (F16 from BF16 through float32, BF16 by
    ggml's rounding), a tensor kept F32 or a permutation not as the converter writes them."""
    src = _model(tmp_path, arch, dtype)
    out = tmp_path / "o.gguf"
    report = _convert(src, out, kind)
    reader = gguf.GGUFReader(out)
    got = {t.name: (int(t.tensor_type), bytes(t.data.tobytes())) for t in reader.tensors}
    want = _expected(src, arch, kind)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] == value, name
    assert reader.fields["general.file_type"].contents() == FILE_TYPES[kind]
    rows = {r["name"]: r for r in report["tensors"]}  # type: ignore[attr-defined]
    assert {r["out_dtype"] for r in rows.values()} == {kind, "F32"}
    assert all(not r["quantized"] for r in rows.values())
    assert report["spec"]["label"] == kind  # type: ignore[index]
    assert report["totals"]["bytes_out"] == sum(len(v[1]) for v in want.values())  # type: ignore[index]
    if arch == "qwen2":
        assert rows["blk.0.attn_q.bias"]["out_dtype"] == "F32"
    model = transformers.AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="o.gguf")
    ids = torch.tensor([[5, 17, 42, 99, 250, 7, 3, 288]])
    with torch.no_grad():
        want_logits, got_logits = model(ids).logits, loaded(ids).logits
    source = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[dtype]
    tol = 1e-5 if kind in ("F32", source) else {"F16": 2e-3, "BF16": 2e-2}[kind]
    if source == "BF16" and kind == "F16":
        tol = 1e-3  # BF16 values F16 cannot hold exactly (tiny ones) round
    torch.testing.assert_close(got_logits, want_logits, rtol=tol, atol=tol)


def test_dry_run_gives_the_file_size_and_writes_nothing(tmp_path: Path) -> None:
    src = _model(tmp_path, "llama", torch.float32)
    out = tmp_path / "o.gguf"
    for flags in (("--dry-run",), ("--dry-run", "--estimate")):
        planned = _convert(src, out, "BF16", *flags)
        assert planned["dry_run"] is True and not out.exists()
    _convert(src, out, "BF16")
    header_and_data = out.stat().st_size
    assert planned["totals"]["bytes_out"] < header_and_data  # type: ignore[index]
    done = _convert(src, tmp_path / "p.gguf", "BF16")
    assert done["tensors"] == planned["tensors"]
    assert done["notes"] == [  # 2 layers x 7 matrices, the embedding, the head; 5 norms
        "a float GGUF, nothing quantized: 16 tensors BF16 as convert_hf_to_gguf.py --outtype "
        "bf16 writes them, 5 F32 (1-D tensors and norms, as it keeps them)"
    ]


def test_bf16_rounding_is_ggmls_nan_included(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16_bits against gguf-py's BF16 on ties, carries into the exponent, overflow to Inf,
    signalling and negative NaNs with payloads (torch's own cast gives other bits: 0xFFFF for
    0xFF812345 and 0x7F800001 on this machine)."""
    rng = np.random.default_rng(0)
    special = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F800001, 0xFF812345,
                        0x7FC00000, 0xFFFFFFFF, 0x80000000, 0x00008000, 0x00018000],
                       dtype=np.uint32)  # fmt: skip
    bits = np.concatenate([special, rng.integers(0, 2**32, 100_000, dtype=np.uint32)])
    a = bits.view(np.float32)
    want = gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16).view(np.uint16)
    np.testing.assert_array_equal(bf16_bits(a), want)
    monkeypatch.setattr(hf_export, "CHUNK", 4_099)  # chunk edges mid-array, a short last one
    np.testing.assert_array_equal(cast(torch.from_numpy(a.copy()), "BF16"), want)
    with np.errstate(over="ignore", invalid="ignore"):
        f16 = a.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(cast(torch.from_numpy(a.copy()), "F16").view(np.uint16), f16)


def test_f16_beyond_its_range_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    """A finite F32 value F16 cannot hold (the converter writes it as Inf): refused in one
    line naming the tensor and the types that hold it; nothing written. 65519 still rounds to
    65504 (not refused); BF16 holds 1e5."""
    src = _model(tmp_path, "llama", torch.float32)
    state = safetensors_torch.load_file(src / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    state[name][0, 0], state[name][1, 1] = 1e5, 65519.0
    safetensors_torch.save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "o.gguf"
    for dry in ((), ("--dry-run", "--estimate")):  # --estimate reads the values: it says so too
        code, stdout, stderr = run_qtool("quantize", str(src), "--format", "gguf", "--dtype",
                                         "F16", "-o", str(out), *dry)  # fmt: skip
        assert code == 1 and stdout == "", dry
        assert name in stderr and "1 values beyond F16's range" in stderr and "100000" in stderr
        assert "BF16 or F32" in stderr and "Traceback" not in stderr
        assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    _convert(src, out, "F16", "--dry-run")  # the plan reads no value
    _convert(src, out, "BF16")


def test_a_generated_tensor_reads_no_input_bytes(tmp_path: Path) -> None:
    """A tensor the conversion generates (llama3's rope_freqs.weight) was counted as bytes of
    the input: every row's bytes in is what the checkpoint stores of it, 0 for one it lacks."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}  # fmt: skip
    src = write_model(tmp_path / "m", "llama", rope_scaling=rope)
    report = _convert(src, tmp_path / "o.gguf", "F16")
    rows = {r["name"]: r for r in report["tensors"]}  # type: ignore[attr-defined]
    assert rows["rope_freqs.weight"]["bytes_in"] == 0
    stored = safetensors_torch.load_file(src / "model.safetensors").values()
    held = sum(v.numel() * v.element_size() for v in stored)
    assert report["totals"]["bytes_in"] == held  # type: ignore[index]


@pytest.mark.parametrize(
    ("args", "code", "match"),
    [
        (("--recipe", "r.toml"), 2, "--recipe"),
        (("--include", "*"), 2, "--include"),
        (("--group-size", "32"), 2, "a float GGUF type, which quantizes nothing; drop"),
        (("--format", "qtool"), 2, "F16"),
        (("--device", "cuda"), 2, "--device"),  # a cast computes on no device: never checked
    ],
)
def test_what_a_conversion_does_not_take_is_a_usage_error(
    tmp_path: Path, args: tuple[str, ...], code: int, match: str
) -> None:
    (tmp_path / "r.toml").write_text('[[rule]]\nmatch = "*"\nkeep = true\n')
    src = _model(tmp_path, "llama", torch.float32)
    out = tmp_path / "o.gguf"
    fmt = () if "--format" in args else ("--format", "gguf")
    got, stdout, stderr = run_qtool("quantize", str(src), *fmt, "--dtype", "F16",
                                    "-o", str(out), *args)  # fmt: skip
    assert got == code, stderr
    assert match in stderr and stdout == "" and not out.exists()


def test_a_gguf_input_is_refused_naming_dequantize(tmp_path: Path) -> None:
    """A float type is the conversion of a model directory; a GGUF (already converted) is
    re-typed by dequantize, which the message names, not silently quantized or copied."""
    src = _model(tmp_path, "llama", torch.float32)
    first = tmp_path / "a.gguf"
    _convert(src, first, "F32")
    out = tmp_path / "b.gguf"
    code, stdout, stderr = run_qtool("quantize", str(first), "--format", "gguf", "--dtype", "F16",
                                     "-o", str(out))  # fmt: skip
    assert code == 2, stderr
    assert "qtool dequantize" in stderr and "is not a model directory" in stderr
    assert stdout == "" and not out.exists()


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "Q8_0", "Q4_K_M"])
def test_a_missing_input_is_named_missing_whatever_the_dtype(tmp_path: Path, dtype: str) -> None:
    """An input path that does not exist is an input error saying so (exit 1) for a conversion
    as for every quantized type, not a usage error calling it 'not a model directory'."""
    out = tmp_path / "o.gguf"
    code, stdout, stderr = run_qtool("quantize", str(tmp_path / "nowhere"), "--format", "gguf",
                                     "--dtype", dtype, "-o", str(out))  # fmt: skip
    assert code == 1, stderr
    assert "no such file or directory" in stderr and "not a model directory" not in stderr
    assert stdout == "" and not out.exists()


@pytest.mark.parametrize(
    ("name", "shape", "f32"),
    [
        ("blk.0.attn_norm.weight", (64,), True),
        ("blk.0.ffn_norm.weight", (2, 64), True),  # a norm stays F32 whatever its rank
        ("blk.0.attn_q.bias", (64,), True),
        ("blk.0.attn_q.bias", (2, 64), True),  # not a .weight: F32 (the converter's rule)
        ("blk.0.attn_q.weight", (64, 64), False),
        ("token_embd.weight", (320, 64), False),
    ],
)
def test_which_tensors_stay_f32_is_the_converters_rule(
    name: str, shape: tuple[int, ...], f32: bool
) -> None:
    """ModelBase.prepare_tensors: n_dims <= 1, a name ending _norm.weight, or one not ending
    .weight stays F32; the tiny models' norms and biases are all 1-D, so the rank alone would
    pass the tests above."""
    assert kept_f32(name, shape) is f32
