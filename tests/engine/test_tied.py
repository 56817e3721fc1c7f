"""An input embedding tied to the output head is one tensor both ends of the model read: the two
formats agree to keep it float by default at 4 bits (compressed-tensors keeps every embedding;
the qtool format quantized it, and SmolLM2's perplexity doubled), the decision says the default
selection kept it and why, a rule that quantizes it to 4 bits anyway gets a warning, and what is
not tied (an untied model, 8 bits) is quantized as before. engine/tied.py decides what is tied."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qtool import api
from qtool.api import QuantizeOptions
from qtool.engine.plan import TIED_KEPT
from qtool.engine.tied import tied_embeddings
from qtool.results import QuantizeRow, QuantizeSummary
from qtool.spec import FormatName, PerGroup, QSpec, StorageDtype
from tests.conftest import SAMPLES

EMBED = "model.embed_tokens.weight"
INT4 = QSpec(dtype=StorageDtype.INT4, granularity=PerGroup(32))


@pytest.fixture
def tied(tmp_path: Path) -> Path:
    """The tiny Llama with tied embeddings (no lm_head.weight, tie_word_embeddings true)."""
    dest = tmp_path / "tiny-lm"
    shutil.copytree(SAMPLES / "tiny-lm", dest)
    return dest


def _plan(src: Path, out: Path, options: QuantizeOptions) -> QuantizeSummary:
    return api.quantize(src, out, options, mode="plan")


def _row(summary: QuantizeSummary) -> QuantizeRow:
    return next(r for r in summary.rows if r.name == EMBED)


@pytest.mark.parametrize("fmt", ["qtool", "compressed-tensors"])
def test_both_formats_keep_a_tied_embedding_float_at_4_bits(
    tied: Path, tmp_path: Path, fmt: str
) -> None:
    summary = _plan(tied, tmp_path / "o", QuantizeOptions(INT4, format=FormatName(fmt)))
    row = _row(summary)
    assert not row.quantized
    assert not any(EMBED in n for n in summary.notes)
    if fmt == "qtool":
        assert row.detail == f"kept: {TIED_KEPT}"
        assert row.decided_by is not None and row.decided_by.origin == "default"


def test_a_rule_that_quantizes_it_to_4_bits_warns(tied: Path, tmp_path: Path) -> None:
    summary = _plan(tied, tmp_path / "o", QuantizeOptions(INT4, include=("*embed*", "*proj*")))
    assert _row(summary).quantized
    assert [n for n in summary.notes if EMBED in n and "output head" in n]


def test_what_is_not_tied_or_not_4_bits_is_quantized_as_before(tied: Path, tmp_path: Path) -> None:
    int8 = _plan(tied, tmp_path / "a", QuantizeOptions())
    assert _row(int8).quantized and not int8.notes
    untied = _plan(SAMPLES / "tiny-llama", tmp_path / "b", QuantizeOptions(INT4))
    assert _row(untied).quantized


def test_what_counts_as_tied() -> None:
    names = [EMBED, "model.layers.0.mlp.up_proj.weight"]
    llama = {"architectures": ["LlamaForCausalLM"]}
    assert tied_embeddings(names, llama) == {EMBED}
    assert tied_embeddings(names, None) == {EMBED}  # a decoder's name, no config
    assert tied_embeddings([*names, "lm_head.weight"], llama) == set()
    assert tied_embeddings(names, llama | {"tie_word_embeddings": False}) == set()
    assert tied_embeddings(names, {"text_config": {"tie_word_embeddings": False}}) == set()
    bert = ["embeddings.word_embeddings.weight"]
    assert tied_embeddings(bert, {"architectures": ["BertModel"]}) == set()  # no head
    assert tied_embeddings(bert, None) == set()  # an encoder's name, no config
    assert tied_embeddings(bert, {"architectures": ["BertForMaskedLM"]}) == set(bert)


def test_a_lone_file_without_config_is_judged_by_its_names(tied: Path, tmp_path: Path) -> None:
    lone = tmp_path / "lone.safetensors"
    shutil.copy(tied / "model.safetensors", lone)
    assert not _row(_plan(lone, tmp_path / "x.safetensors", QuantizeOptions(INT4))).quantized
    assert json.loads((tied / "config.json").read_text())["tie_word_embeddings"] is True
