"""quantize HF_DIR --format gguf (formats/gguf/hf_export.py, hf_vocab.py, engine/hf_gguf.py): a
tiny Llama, Mistral and Qwen2 (biases) built offline, converted, and read back by transformers'
GGUF loader, which undoes llama.cpp's layout itself: same logits (names, q/k row permutation,
biases, tied embeddings), same token ids (vocabulary, merges, special tokens), metadata as the
converter writes it. The real-model proof (byte-identical to convert_hf_to_gguf.py and
llama-quantize on SmolLM2) is docs/gguf.md's, made with scripts/compare_gguf_files.py."""

from __future__ import annotations

import json
import shutil
from hashlib import sha256
from pathlib import Path

import gguf
import pytest
import torch

from qtool.errors import InputError
from qtool.formats.gguf import hf_vocab
from qtool.formats.gguf.hf_export import export_float
from qtool.io.atomic import OutputSet
from tests.conftest import run_qtool
from tests.formats.gguf.hf_models import CHAT_TEMPLATE, TEXT, VOCAB_SIZE, write_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def known_pre_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny tokenizer's pre-tokenizer taken as llama.cpp's "gpt-2" (the converter's table
    knows only released models' hashes); test_unknown_pre_tokenizer_is_refused replaces it."""
    monkeypatch.setattr(hf_vocab, "PRE_TOKENIZERS", _Table(hf_vocab.PRE_TOKENIZERS))


class _Table(dict[str, str]):
    """PRE_TOKENIZERS that answers "gpt-2" for a hash it lacks."""

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(key, "gpt-2")


def _export(src: Path, out: Path, float_type: str | None = "F32") -> gguf.GGUFReader:
    with OutputSet() as outputs:
        export_float(src, out, outputs, float_type)
        outputs.commit()
    return gguf.GGUFReader(out)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[5, 17, 42, 99, 250, 7, 3, 288]])
    with torch.no_grad():
        logits: torch.Tensor = model(ids).logits
    return logits


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("llama", True),
                                            ("mistral", False), ("qwen2", True)])  # fmt: skip
def test_transformers_reads_the_export_as_the_model(tmp_path: Path, arch: str, tied: bool) -> None:
    """transformers' GGUF loader de-permutes q/k for llama and maps names back: the same logits
    as the checkpoint's model prove the names, the rotary permutation and the biases."""
    src = write_model(tmp_path / "m", arch, tied=tied)
    _export(src, tmp_path / "m.gguf")
    want = _logits(transformers.AutoModelForCausalLM.from_pretrained(src))
    got = _logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_llama_q_and_k_rows_are_permuted(tmp_path: Path) -> None:
    """The GGUF's attn_q/attn_k rows are the converter's permutation of q_proj/k_proj (for
    llama only; qwen2's are as they are), not the checkpoint's order."""
    from safetensors.torch import load_file

    for arch, permuted in (("llama", True), ("qwen2", False)):
        src = write_model(tmp_path / arch, arch)
        reader = _export(src, tmp_path / f"{arch}.gguf")
        state = load_file(src / "model.safetensors")
        tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
        k = state["model.layers.0.self_attn.k_proj.weight"]
        heads = 2
        want = k.reshape(heads, 2, k.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(k.shape)
        got = tensors["blk.0.attn_k.weight"]
        assert torch.equal(got, want.float() if permuted else k.float())
        assert not torch.equal(want, k)  # the permutation moves rows


def test_metadata_as_the_converter_writes_it(tmp_path: Path) -> None:
    src = write_model(tmp_path / "m", "qwen2", tied=True)
    reader = _export(src, tmp_path / "m.gguf", None)
    keys = {k: f.contents() for k, f in reader.fields.items()}
    assert keys["general.architecture"] == "qwen2"
    assert keys["qwen2.block_count"] == 2
    assert keys["qwen2.context_length"] == 128
    assert keys["qwen2.embedding_length"] == 64
    assert keys["qwen2.feed_forward_length"] == 96
    assert keys["qwen2.attention.head_count"] == 4
    assert keys["qwen2.attention.head_count_kv"] == 2
    assert keys["qwen2.rope.freq_base"] == 10000.0
    assert keys["qwen2.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert keys["general.file_type"] == 1  # float32 checkpoint: the converter's auto is F16
    assert keys["tokenizer.ggml.model"] == "gpt2"
    assert keys["tokenizer.ggml.pre"] == "gpt-2"
    assert len(keys["tokenizer.ggml.tokens"]) == VOCAB_SIZE
    assert keys["tokenizer.ggml.tokens"][-1] == f"[PAD{VOCAB_SIZE - 1}]"
    types = keys["tokenizer.ggml.token_type"]
    assert types[:3] == [3, 3, 3] and types[-1] == 5 and types[100] == 1
    assert keys["tokenizer.ggml.merges"]
    assert keys["tokenizer.ggml.bos_token_id"] == 1  # <|im_start|>
    assert keys["tokenizer.ggml.eos_token_id"] == 0
    assert keys["tokenizer.ggml.padding_token_id"] == 2
    assert keys["tokenizer.chat_template"] == CHAT_TEMPLATE
    names = {t.name: t for t in reader.tensors}
    assert "output.weight" not in names  # tied: llama.cpp reuses token_embd.weight
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= set(names)
    assert names["blk.0.attn_q.weight"].tensor_type.name == "F16"
    assert names["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    llama = {k: f.contents() for k, f in _export(write_model(tmp_path / "l", "llama"),
                                                  tmp_path / "l.gguf").fields.items()}  # fmt: skip
    assert llama["llama.vocab_size"] == VOCAB_SIZE
    assert llama["llama.rope.dimension_count"] == 16


def test_tokenizer_round_trip_through_transformers(tmp_path: Path) -> None:
    """transformers' GGUF tokenizer (built from tokens, types and merges) gives the ids the
    checkpoint's tokenizer gives."""
    src = write_model(tmp_path / "m", "llama")
    _export(src, tmp_path / "m.gguf")
    want = transformers.AutoTokenizer.from_pretrained(src)
    got = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in (TEXT, "fox <|im_start|>jumps", "naïve émoji 🦙 3333"):
        assert (
            got(text, add_special_tokens=False).input_ids
            == want(text, add_special_tokens=False).input_ids
        )


def test_unknown_pre_tokenizer_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pre-tokenizer whose hash llama.cpp's converter does not know: refused (llama.cpp would
    split text otherwise than the model was trained on)."""
    monkeypatch.setattr(hf_vocab, "PRE_TOKENIZERS", {})
    src = write_model(tmp_path / "m", "llama")
    with pytest.raises(InputError, match="pre-tokenizer .* not one llama.cpp"):
        _export(src, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_pre_tokenizer_table_is_the_converters() -> None:
    """get_vocab_base_pre's text, byte for byte (its hash of ids is only as good as the text),
    and its table's entries for the models this export is for."""
    assert sha256(hf_vocab.CHECK_TEXT.encode()).hexdigest() == CHECK_TEXT_SHA256
    table = hf_vocab.PRE_TOKENIZERS
    assert table["855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"] == "smollm"
    assert {"llama-bpe", "qwen2", "smollm", "gpt-2", "tekken"} <= set(table.values())


CHECK_TEXT_SHA256 = "a36179c1e2b1cfcfbfad1dc779addad2ffc778201e4cf0d538bddeafa2c526da"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("sentencepiece", "without its tokenizer.model"),
        ("byte_fallback", "not a byte-level BPE tokenizer"),
        ("architecture", "qtool converts LlamaForCausalLM"),
        ("no_tokenizer", "no tokenizer.json"),
    ],
)
def test_what_is_refused_says_so(tmp_path: Path, change: str, match: str) -> None:
    """Each model qtool does not convert is refused in one line naming the file and what to
    do (llama.cpp's converter), exit 1, nothing written."""
    src = write_model(tmp_path / "m", "llama")
    if change == "sentencepiece":  # the converter's LlamaHfVocab kind: it drops the scores
        data = json.loads((src / "tokenizer.json").read_text())
        data["model"]["byte_fallback"] = True
        data["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}]}
        (src / "tokenizer.json").write_text(json.dumps(data))
    elif change == "byte_fallback":
        data = json.loads((src / "tokenizer.json").read_text())
        data["model"]["byte_fallback"] = True
        (src / "tokenizer.json").write_text(json.dumps(data))
    elif change == "architecture":
        config = json.loads((src / "config.json").read_text())
        config["architectures"] = ["GPT2LMHeadModel"]
        (src / "config.json").write_text(json.dumps(config))
    else:
        (src / "tokenizer.json").unlink()
    out = tmp_path / "o.gguf"
    code, stdout, stderr = run_qtool("quantize", str(src), "--format", "gguf", "--dtype",
                                     "Q8_0", "-o", str(out))  # fmt: skip
    assert code == 1, stderr
    assert stdout == ""
    assert match in stderr and "convert_hf_to_gguf.py" in stderr
    assert "Traceback" not in stderr
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_cli_quantizes_what_the_export_quantizes(tmp_path: Path) -> None:
    """quantize HF_DIR --format gguf --dtype Q4_K_M writes the bytes that quantizing the float
    export does (the llama.cpp way, convert then quantize), and leaves no scratch behind."""
    src = write_model(tmp_path / "m", "llama")
    _export(src, tmp_path / "float.gguf", None)
    direct, converted = tmp_path / "a.gguf", tmp_path / "b.gguf"
    for inp, out in ((tmp_path / "float.gguf", direct), (src, converted)):
        code, _, stderr = run_qtool("quantize", str(inp), "--format", "gguf", "--dtype",
                                    "Q4_K_M", "-o", str(out))  # fmt: skip
        assert code == 0, stderr
    assert converted.read_bytes() == direct.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "float.gguf", "m"]
    shutil.rmtree(src)


def test_llama3_rope_scaling_writes_the_factors_transformers_applies(tmp_path: Path) -> None:
    """rope_type llama3 (Llama 3.1+): llama.cpp takes the per-frequency factors as the
    rope_freqs.weight tensor the converter generates; they are the ratio by which transformers'
    own llama3 rope divides each inverse frequency."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}  # fmt: skip
    src = write_model(tmp_path / "m", "llama", rope_scaling=rope)
    reader = _export(src, tmp_path / "m.gguf")
    got = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}["rope_freqs.weight"]
    config = transformers.AutoConfig.from_pretrained(src)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    base = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    torch.testing.assert_close(got, base / scaled, rtol=1e-5, atol=0)
    assert len(set(got.tolist())) > 2  # low, high and smoothed frequencies all present


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_report_describes_the_checkpoint_not_the_scratch_copy(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """The report's input dtype and bytes are the checkpoint's: an F32 checkpoint's scratch
    copy is F16, half its size, and the report said so (201 KiB F16 for 403 KiB of F32)."""
    from safetensors.torch import load_file, save_file

    src = write_model(tmp_path / "m", "llama")
    state = {k: v.to(dtype) for k, v in load_file(src / "model.safetensors").items()}
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    code, out, err = run_qtool(
        "quantize", str(src), "--format", "gguf", "--dtype", "Q8_0",
        "-o", str(tmp_path / "o.gguf"), "--json",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    name = "F32" if dtype is torch.float32 else "BF16"
    rows = report["tensors"]
    assert {r["dtype"] for r in rows} == {name}
    held = sum(t.numel() * t.element_size() for t in state.values())
    assert report["totals"]["bytes_in"] == sum(r["bytes_in"] for r in rows) == held
