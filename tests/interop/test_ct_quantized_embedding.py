"""Why qtool's compressed-tensors export keeps the input embedding float (issue 32: the tied
embedding is half of SmolLM2's file, the lever the allocation lacks at int4 g64's size), checked
with the real consumers rather than taken from their docs.

compressed-tensors 0.20 itself handles an nn.Embedding (COMPRESSIBLE_MODULE_TYPES; apply and
forward take Linear or Embedding) and decompresses a pack-quantized table exactly, but:
- transformers 5.23's default path fails to load ANY checkpoint whose embedding is quantized,
  tied or not, 8 or 4 bits (its weight init reads `Embedding.weight`, which compression removed);
- its load-time dequantization (`"dequantize": true`) reads it exactly, but applies one config
  group's args to every module, so an export with several schemes (every allocation) fails;
- compressed-tensors alone decompresses the table but leaves a tied head detached from it;
- vLLM (read, not run: its CompressedTensorsConfig.get_quant_method has no method for
  VocabParallelEmbedding) builds a float embedding with no parameter for `weight_packed`.
The canaries below fail when upstream changes: then revisit selection.py's rule and
docs/calibration.md ("The embedding in compressed-tensors"). The files are made by hand with
qtool's own encoder (codec.encode_weight), exactly as the export writes a Linear.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REASON = "needs the interop extra: pip install -c constraints.txt -e '.[interop]'"
transformers = pytest.importorskip("transformers", reason=REASON)
pytest.importorskip("compressed_tensors", reason=REASON)

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from qtool.formats.compressed_tensors.codec import encode_weight  # noqa: E402
from qtool.formats.compressed_tensors.config import weights_args  # noqa: E402
from qtool.formats.compressed_tensors.selection import PACK_QUANTIZED  # noqa: E402
from qtool.formats.registry import open_reader  # noqa: E402
from qtool.spec import parse_spec_label  # noqa: E402
from tests.conftest import Invoke  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")  # third-party loaders warn freely

EMBED = "model.embed_tokens"
IDS = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))


def llama(tied: bool) -> Any:
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        tie_word_embeddings=tied, architectures=["LlamaForCausalLM"],
    )  # fmt: skip


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ct-embedding")


def float_model(root: Path, tied: bool) -> Path:
    path = root / ("tied" if tied else "untied")
    if not path.exists():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(llama(tied))
        model.to(torch.bfloat16).eval().save_pretrained(path)
    return path


def group(targets: list[str], label: str) -> dict[str, object]:
    weights = weights_args(parse_spec_label(label, writable=True))
    return {"targets": targets, "weights": weights, "input_activations": None,
            "output_activations": None, "format": PACK_QUANTIZED}  # fmt: skip


def with_quantized_embedding(
    src: Path, dst: Path, label: str, *, linears: str | None = None, dequantize: bool = False
) -> torch.Tensor:
    """`src` (float) as a compressed-tensors directory whose embedding is `label`, and every
    Linear but the head `linears` when given (else float); returns the dequantized table."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    groups = {"group_0": group([EMBED], label)}
    modules = [EMBED]
    if linears is not None:
        groups["group_1"] = group(["Linear"], linears)
        modules += [n[: -len(".weight")] for n in tensors if n.endswith("_proj.weight")]
    table = torch.empty(0)
    for module in modules:
        spec = parse_spec_label(label if module == EMBED else str(linears), writable=True)
        encoded = encode_weight(tensors.pop(f"{module}.weight"), spec)
        tensors.update({f"{module}.{k}": v for k, v in encoded.tensors.items()})
        if module == EMBED:
            table = dequantized(encoded, spec)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    doc = json.loads((src / "config.json").read_text())
    doc["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": PACK_QUANTIZED,
        "quantization_status": "compressed", "config_groups": groups, "ignore": ["lm_head"],
        "kv_cache_scheme": None, "global_compression_ratio": None,
        **({"dequantize": True} if dequantize else {}),
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(doc))
    return table


def dequantized(encoded: Any, spec: Any) -> torch.Tensor:
    from qtool.formats.compressed_tensors.codec import dequantize_module
    from qtool.formats.compressed_tensors.config import parse_args

    args = parse_args("embedding", weights_args(spec), PACK_QUANTIZED)
    return dequantize_module(encoded.tensors, args, PACK_QUANTIZED)


def float_with_table(src: Path, table: torch.Tensor) -> Any:
    """The float model with `table` as its embedding (and as its head when tied)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(table)
    return model


@pytest.mark.parametrize("label", ["int8 channel", "int4 g32"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_transformers_default_path_cannot_load_a_quantized_embedding(
    root: Path, tied: bool, label: str
) -> None:
    """The export's default (no "dequantize") is what users and vLLM-bound files get."""
    out = root / f"default-{tied}-{label.replace(' ', '-')}"
    with_quantized_embedding(float_model(root, tied), out, label, linears="int4 g32")
    with pytest.raises(AttributeError, match="'Embedding' object has no attribute 'weight'"):
        transformers.AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_dequantize_at_load_reads_a_single_scheme_exactly(root: Path, tied: bool) -> None:
    src = float_model(root, tied)
    out = root / f"dequantize-{tied}"
    table = with_quantized_embedding(src, out, "int8 channel", dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(model.model.embed_tokens.weight, table)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    reference = float_with_table(src, table)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


def test_dequantize_at_load_cannot_load_mixed_schemes(root: Path) -> None:
    """An allocation mixes schemes by design, and this is the only path left to it."""
    out = root / "dequantize-mixed"
    table = with_quantized_embedding(float_model(root, True), out, "int8 channel",
                                     linears="int4 g32", dequantize=True)  # fmt: skip
    with pytest.raises(RuntimeError, match="conversion of the weights"):
        transformers.AutoModelForCausalLM.from_pretrained(out)
    reader = open_reader(out)  # qtool reads it, the embedding included
    try:
        assert torch.equal(reader.values(f"{EMBED}.weight"), table)
    finally:
        reader.close()


def test_compressed_tensors_decompresses_the_table_but_leaves_a_tied_head_detached(
    root: Path,
) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    out = root / "ct-alone"
    table = with_quantized_embedding(float_model(root, True), out, "int4 g32", linears="int8")
    doc = json.loads((out / "config.json").read_text())
    config = QuantizationConfig.model_validate(doc["quantization_config"])
    model = transformers.AutoModelForCausalLM.from_config(llama(True)).to(torch.bfloat16)
    apply_quantization_config(model, config, run_compressed=False)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(model)
    missing, unexpected = model.load_state_dict(load_file(out / "model.safetensors"), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []
    compressor.decompress_model(model)
    assert torch.equal(model.model.embed_tokens.weight, table)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight, table)  # the head is whatever init left


def test_a_rule_for_the_embedding_says_the_loaders_cannot_load_it(
    invoke: Invoke, root: Path, tmp_path: Path
) -> None:
    """So the export keeps it float whatever a rule asks, and says why in the loaders' terms."""
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[rule]]\nmatch = "model.embed_tokens.weight"\ndtype = "int8"\n')
    code, stdout, err = invoke("quantize", str(float_model(root, True)), "--format",
                               "compressed-tensors", "--recipe", str(recipe), "--dtype", "int4",
                               "--dry-run", "--json", "-o", str(tmp_path / "out"))  # fmt: skip
    assert code == 0, err
    detail = {t["name"]: t["detail"] for t in json.loads(stdout)["tensors"]}[f"{EMBED}.weight"]
    assert "transformers and vLLM load no quantized embedding" in detail, detail
