"""A qtool-format model directory (codes under the original names) is never loaded as a float
model: transformers' Auto classes and sentence-transformers refuse it with a message that says
what it is, while qtool itself reads it (inspect, compare, dequantize back to a loadable float
directory), and reads the directories written before the mark, whose config.json is plain."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.interop.test_interop_archs import REASON, build_sentence_transformer

transformers = pytest.importorskip("transformers", reason=REASON)

import torch  # noqa: E402

from qtool import api  # noqa: E402
from qtool.api import QuantizeOptions  # noqa: E402
from qtool.formats.detect import detect  # noqa: E402
from qtool.formats.qtool.config import MODEL_TYPE  # noqa: E402
from tests.conftest import SAMPLES  # noqa: E402

REFUSED = r"model type `qtool-quantized: integer codes, not float weights"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_transformers_refuses_a_qtool_directory_and_qtool_reads_it(tmp_path: Path) -> None:
    src = tmp_path / "llama"
    shutil.copytree(SAMPLES / "tiny-llama", src)
    api.quantize(src, tmp_path / "q", QuantizeOptions(), device="cpu")
    with pytest.raises(ValueError, match=REFUSED):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    found = detect(tmp_path / "q")
    assert found.quantized and found.config == json.loads((src / "config.json").read_text())
    assert api.compare(src, tmp_path / "q").rows  # qtool reads it
    api.dequantize(tmp_path / "q", tmp_path / "f")
    assert json.loads((tmp_path / "f" / "config.json").read_text()) == found.config
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "f")
    assert bool(torch.isfinite(loaded(torch.tensor([[1, 2, 3]])).logits).all())


def test_a_directory_written_before_the_mark_still_reads(tmp_path: Path) -> None:
    src = tmp_path / "llama"
    shutil.copytree(SAMPLES / "tiny-llama", src)
    api.quantize(src, tmp_path / "q", QuantizeOptions(), device="cpu")
    shutil.copy(src / "config.json", tmp_path / "q" / "config.json")  # as qtool wrote it before
    assert detect(tmp_path / "q").quantized
    api.dequantize(tmp_path / "q", tmp_path / "f")
    assert (tmp_path / "f" / "config.json").read_bytes() == (src / "config.json").read_bytes()


@pytest.mark.filterwarnings("ignore")
def test_sentence_transformers_refuses_a_qtool_directory(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    src = build_sentence_transformer(tmp_path)
    out = tmp_path / "st.int8"
    api.quantize(src, out, QuantizeOptions(), device="cpu")
    assert json.loads((out / "config.json").read_text())["model_type"] == MODEL_TYPE
    with pytest.raises(ValueError, match=REFUSED):
        SentenceTransformer(str(out), device="cpu")
    api.dequantize(out, tmp_path / "f")
    SentenceTransformer(str(tmp_path / "f"), device="cpu").encode(["the cat sat"])
