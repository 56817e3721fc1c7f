"""`qtool eval FLOAT model.gguf` (issue 23 item 4): a GGUF file is read as QUANT under FLOAT's
tensor names and in its layout (formats/registry.open_matching: gguf-py's TensorNameMap, the
q/k rows un-permuted), dequantized and run in FLOAT's architecture. The float GGUF of FLOAT is
exactly FLOAT (every figure equal); a file qtool quantized runs close to it; a GGUF of another
model is refused naming what does not match."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from qtool import api  # noqa: E402
from qtool.errors import InputError  # noqa: E402
from qtool.eval_results import EvalSummary  # noqa: E402
from tests import gguf_models as M  # noqa: E402
from tests.conftest import Invoke  # noqa: E402
from tests.gguf_files import odd_gguf  # noqa: E402

TEXT = "the cat sat on the mat, and the dog ate the hat; a thin man in a tent " * 8


def _save_tokenizer(directory: Path) -> None:
    """The byte-level BPE of tests/gguf_models.py (what its GGUFs carry) as tokenizer.json."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = M.vocabulary()
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [(a, b) for a, b in (m.split(" ") for m in merges)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(directory)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gguf-eval")
    M.make_hf_llama(d / "float")
    _save_tokenizer(d / "float")
    M.write_float_gguf(d / "float", d / "f32.gguf", "F32")
    (d / "text.txt").write_text(TEXT)
    return d


def _eval(root: Path, quant: Path) -> EvalSummary:
    options = api.EvalOptions(text=root / "text.txt", tokens=120, ctx=64)
    return api.evaluate(root / "float", quant, options)


def test_the_float_gguf_of_float_is_exactly_float(root: Path) -> None:
    s = _eval(root, root / "f32.gguf")
    assert s.causal is not None and s.causal.kl.max == 0.0 and s.causal.top1 == 1.0
    assert s.causal.ppl_ratio == 1.0 and s.changed == 0


def test_a_gguf_qtool_quantized_runs_close_to_float(invoke: Invoke, root: Path) -> None:
    q8 = root / "q8.gguf"
    code, _, err = invoke("quantize", str(root / "f32.gguf"), "--format", "gguf", "--dtype",
                          "Q8_0", "-o", str(q8))  # fmt: skip
    assert code == 0, err
    s = _eval(root, q8)
    assert s.loaded_as == "qtool reader, dequantized in memory"
    assert s.causal is not None and 0 < s.causal.kl.mean < 1e-3 and s.causal.top1 > 0.95
    assert s.changed > 0
    code, out, err = invoke("eval", str(root / "float"), str(q8), "--text",
                            str(root / "text.txt"), "--tokens", "120")  # fmt: skip
    assert code == 0, err
    assert "q8.gguf (qtool reader, dequantized in memory)" in out


def test_a_gguf_of_another_model_is_refused_naming_the_tensors(root: Path) -> None:
    other = odd_gguf(root / "other.gguf")
    with pytest.raises(InputError, match="not a checkpoint of FLOAT's model: it lacks"):
        _eval(root, other)
