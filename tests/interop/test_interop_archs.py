"""Issue 18 item 4: qtool's compressed-tensors exports of real architectures load in the real
consumers on their DEFAULT path (no CompressedTensorsConfig, no model_kwargs), offline.

Tiny random models (seed 0) built from configs of real architectures:
- a Llama with tied embeddings (SmolLM2, Llama 3.2): the checkpoint has no lm_head.weight;
- an untied Llama;
- a Qwen2 (attention biases, tied embeddings like Qwen2.5-0.5B);
- a BERT in sentence-transformers layout (modules.json, 1_Pooling/, 2_Normalize/).
Each is exported int8 per channel and int4 group 32 with `qtool quantize --format
compressed-tensors` and loaded with `AutoModelForCausalLM.from_pretrained(out)` (the BERT:
`SentenceTransformer(out).encode`): every Linear the loader built equals qtool's dequantization
(a tied head equals the embeddings), a forward pass (and greedy generation) runs, and the output
stays close to the float model's. docs/formats.md lists these architectures.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REASON = "needs the interop extra: pip install -c constraints.txt -e '.[interop]'"
transformers = pytest.importorskip("transformers", reason=REASON)
pytest.importorskip("compressed_tensors", reason=REASON)

import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from qtool.cli import app  # noqa: E402
from qtool.formats.registry import open_reader  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")  # third-party loaders warn freely

SPECS = {"int8-channel": ["--dtype", "int8"], "int4-g32": ["--dtype", "int4", "--group-size", "32"]}
BOUNDS = {"int8-channel": 0.05, "int4-g32": 0.4}  # output rel error vs the float model
IDS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))


def llama(tied: bool) -> Any:
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        tie_word_embeddings=tied, architectures=["LlamaForCausalLM"],
    )  # fmt: skip


def qwen2() -> Any:
    return transformers.Qwen2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"],
    )  # fmt: skip


DECODERS: dict[str, Callable[[], Any]] = {
    "llama-tied": lambda: llama(True),
    "llama-untied": lambda: llama(False),
    "qwen2-tied-bias": qwen2,
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("archs")


def build_decoder(root: Path, name: str) -> Path:
    path = root / name
    if not path.exists():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(DECODERS[name]())
        model.to(torch.bfloat16).eval().save_pretrained(path)
    return path


def export(src: Path, dst: Path, spec: str) -> None:
    if dst.exists():
        return
    result = CliRunner().invoke(
        app, ["quantize", str(src), "--format", "compressed-tensors", *SPECS[spec], "-o", str(dst)]
    )
    assert result.exit_code == 0, result.stderr


def qtool_read(path: Path) -> dict[str, torch.Tensor]:
    reader = open_reader(path)
    try:
        return {name: reader.values(name).clone() for name in reader.names}
    finally:
        reader.close()


def linear_weights(model: Any) -> dict[str, torch.Tensor]:
    return {
        f"{n}.weight": m.weight.detach()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


# ---------------------------------------------------------------- decoders, transformers


@dataclass(frozen=True)
class Loaded:
    model: Any
    logits: torch.Tensor


def load_default(path: Path) -> Loaded:
    """AutoModelForCausalLM.from_pretrained(path) as a user writes it, and one forward pass."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return Loaded(model, model(input_ids=IDS).logits)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("name", DECODERS)
def test_decoders_load_on_the_default_path_with_qtools_weights(
    root: Path, name: str, spec: str
) -> None:
    src = build_decoder(root, name)
    out = root / f"{name}-{spec}"
    export(src, out, spec)
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["ignore"] == ["lm_head"] and "dequantize" not in q
    loaded = load_default(out)
    ours = qtool_read(out)
    weights = linear_weights(loaded.model)
    assert len(weights) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    head = "model.embed_tokens.weight" if "tied" in name and "untied" not in name else None
    for linear, w in weights.items():
        expected = ours[head] if linear == "lm_head.weight" and head else ours[linear]
        assert torch.equal(w, expected), linear
    if name.startswith("qwen2"):  # the attention biases ride along as float
        bias = loaded.model.model.layers[0].self_attn.q_proj.bias
        assert torch.equal(bias.detach(), ours["model.layers.0.self_attn.q_proj.bias"])
    reference = load_default(src)
    assert rel_error(loaded.logits, reference.logits) < BOUNDS[spec]
    generated = loaded.model.generate(IDS[:1, :4], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 8)


def test_the_tied_head_must_be_ignored_for_transformers_to_load(root: Path) -> None:
    """Why `ignore` names lm_head (issue 18): without it transformers 5.23 builds lm_head as a
    compressed Linear the checkpoint has no tensors for, and fails. When upstream fixes this,
    this test fails: then update docs/formats.md."""
    src = build_decoder(root, "llama-tied")
    out = root / "llama-tied-int8-channel"
    export(src, out, "int8-channel")
    broken = root / "llama-tied-no-ignore"
    broken.mkdir()
    for f in out.iterdir():
        if f.is_file() and not f.name.startswith("."):
            (broken / f.name).write_bytes(f.read_bytes())
    doc = json.loads((broken / "config.json").read_text())
    doc["quantization_config"]["ignore"] = []
    (broken / "config.json").write_text(json.dumps(doc))
    with pytest.raises(AttributeError, match="weight"):
        load_default(broken)


def test_an_ignore_entry_naming_no_module_is_harmless(root: Path) -> None:
    """transformers and compressed-tensors match `ignore` entries module by module (vLLM too:
    should_ignore_layer), so a name the model lacks changes nothing."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    src = build_decoder(root, "llama-untied")
    out = root / "llama-untied-int8-channel"
    export(src, out, "int8-channel")
    extra = root / "llama-untied-extra-ignore"
    extra.mkdir()
    for f in out.iterdir():
        if f.is_file() and not f.name.startswith("."):
            (extra / f.name).write_bytes(f.read_bytes())
    doc = json.loads((extra / "config.json").read_text())
    doc["quantization_config"]["ignore"] += ["model.layers.7.no_such_proj", "re:^nothing$"]
    (extra / "config.json").write_text(json.dumps(doc))
    assert torch.equal(load_default(extra).logits, load_default(out).logits)
    qc = QuantizationConfig.model_validate(doc["quantization_config"])
    model = transformers.AutoModelForCausalLM.from_config(llama(False))
    apply_quantization_config(model, qc)  # no error, no warning about ignore entries


# ---------------------------------------------------------------- sentence-transformers

SENTENCES = ["the cat sat on the mat", "a dog runs in the park", "tiny models quantize well"]
WORDS = sorted({w for s in SENTENCES for w in s.split()} | {"hello", "world"})


def build_sentence_transformer(root: Path) -> Path:
    """A tiny BERT saved by sentence-transformers itself: modules.json, 1_Pooling/,
    2_Normalize/, its configs, a WordPiece tokenizer (no download)."""
    st = pytest.importorskip("sentence_transformers", reason=REASON)
    from sentence_transformers.sentence_transformer import modules

    path = root / "bert-st"
    if path.exists():
        return path
    hf = root / "bert-hf"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    hf.mkdir()
    (hf / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(str(hf / "vocab.txt")).save_pretrained(hf)
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=64, architectures=["BertModel"],
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).eval().save_pretrained(hf)
    transformer = modules.Transformer(str(hf))
    pooling = modules.Pooling(transformer.get_embedding_dimension(), "mean")
    st.SentenceTransformer(modules=[transformer, pooling, modules.Normalize()]).save(str(path))
    return path


def encode(path: Path) -> tuple[Any, torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")  # the default path: nothing else
    return model, model.encode(SENTENCES, convert_to_tensor=True)


@pytest.mark.parametrize("spec", SPECS)
def test_sentence_transformers_loads_the_export_on_its_default_path(root: Path, spec: str) -> None:
    src = build_sentence_transformer(root)
    assert {"modules.json", "1_Pooling", "2_Normalize"} <= {p.name for p in src.iterdir()}
    out = root / f"bert-st-{spec}"
    export(src, out, spec)
    assert (out / "1_Pooling" / "config.json").read_bytes() == (
        src / "1_Pooling" / "config.json"
    ).read_bytes()
    assert (out / "2_Normalize").is_dir()
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["dequantize"] is True  # sentence-transformers skips transformers' decompress hook
    model, embeddings = encode(out)
    ours = qtool_read(out)
    weights = linear_weights(model[0].model)
    assert len(weights) == 2 * 6 + 1  # q k v o, intermediate, output per layer, and the pooler
    for linear, w in weights.items():
        assert torch.equal(w, ours[linear]), linear
    _, reference = encode(src)
    cosine = torch.nn.functional.cosine_similarity(embeddings, reference)
    assert float(cosine.min()) > (0.99 if spec.startswith("int8") else 0.9), cosine


def test_a_mixed_scheme_sentence_transformers_export_warns_and_loads_by_hand(root: Path) -> None:
    """Several config groups: transformers cannot dequantize at load time (one scheme for all),
    so qtool writes no `dequantize` and says so; the documented call decompresses it."""
    src = build_sentence_transformer(root)
    out = root / "bert-st-mixed"
    result = CliRunner().invoke(app, ["quantize", str(src), "--format", "compressed-tensors",
                                      "--dtype", "int4", "--group-size", "256",
                                      "--group-fallback", "channel", "-o", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "mixes schemes" in result.stderr
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert len(q["config_groups"]) == 2 and "dequantize" not in q
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(out), device="cpu")
    hf = model[0].model  # docs/formats.md: what transformers' first-forward hook would do
    hf.hf_quantizer.compressor.decompress_model(hf)
    embeddings = model.encode(SENTENCES, convert_to_tensor=True)
    ours = qtool_read(out)
    for linear, w in linear_weights(hf).items():
        assert torch.equal(w, ours[linear]), linear
    assert torch.isfinite(embeddings).all()
