"""SentencePiece vocabularies in the HF -> GGUF export (formats/gguf/sp_model.py, hf_vocab.py):
tokenizer.model read without sentencepiece, checked against sentencepiece itself on trained
models; the tokenizer.* keys against the ones llama.cpp's converter wrote for the same tiny
directories (recorded by scripts/sp_vocab_golden.py); the GGUF's tokenizer through
transformers' GGUF loader gives sentencepiece's ids. The by-hand proof (whole files
byte-identical to convert_hf_to_gguf.py, llama-tokenize's ids) is docs/gguf.md's."""

from __future__ import annotations

from hashlib import sha256
from pathlib import Path

import gguf
import pytest

from qtool.formats.gguf import sp_model
from qtool.formats.gguf.hf_export import export_float
from qtool.io.atomic import OutputSet
from tests.formats.gguf.sp_models import CONTROL, SAMPLES, USER, build, train, vocab_digest

spm = pytest.importorskip("sentencepiece")


def _reference(model: bytes) -> list[tuple[str, float, int]]:
    """Each id's piece, score and type as sentencepiece reports them (it has no IsUserDefined:
    a piece none of its predicates names is NORMAL or USER_DEFINED; USER lists the latter)."""
    sp = spm.SentencePieceProcessor(model_proto=model)
    out = []
    for i in range(sp.vocab_size()):
        piece = sp.IdToPiece(i)
        kind = (
            sp_model.UNKNOWN if sp.IsUnknown(i) else sp_model.CONTROL if sp.IsControl(i)
            else sp_model.UNUSED if sp.IsUnused(i) else sp_model.BYTE if sp.IsByte(i)
            else sp_model.USER_DEFINED if piece in USER else sp_model.NORMAL
        )  # fmt: skip
        out.append((piece, sp.GetScore(i), kind))
    return out


@pytest.mark.parametrize(
    ("model_type", "byte_fallback", "size"),
    [("bpe", True, 400), ("bpe", False, 150), ("unigram", True, 360), ("unigram", False, 100)],
)
def test_reader_gives_what_sentencepiece_gives(
    tmp_path: Path, model_type: str, byte_fallback: bool, size: int
) -> None:
    """Every piece's text, score (bit for bit: a GGUF stores the float32) and type, in id
    order, for BPE and unigram models with and without byte pieces, user-defined and control
    symbols."""
    model = train(model_type, byte_fallback, size, user_defined_symbols=USER,
                  control_symbols=CONTROL)  # fmt: skip
    path = tmp_path / "tokenizer.model"
    path.write_bytes(model)
    got = [(p.text, p.score, p.kind) for p in sp_model.read_pieces(path)]
    want = _reference(model)
    assert len(got) == size
    assert [(t, k) for t, _, k in got] == [(t, k) for t, _, k in want]
    assert [str(s) for _, s, _ in got] == [str(s) for _, s, _ in want]  # -0.0 stays -0.0
    kinds = {k for _, _, k in got}
    assert {sp_model.UNKNOWN, sp_model.CONTROL, sp_model.USER_DEFINED} <= kinds
    assert (sp_model.BYTE in kinds) == byte_fallback


def _export(src: Path, out: Path) -> gguf.GGUFReader:
    with OutputSet() as outputs:
        export_float(src, out, outputs, "F32")
        outputs.commit()
    return gguf.GGUFReader(out)


GOLDEN = {
    "llama2": "4cc21272231391970024cf8800f40649ab295e6010bc9c991acad53fe0f10a83",
    "mistral": "e717f95def25f1abccbd3890259d7803485c389f10ae3108747cb972ed92b09c",
    "tinyllama": "5eef5b1b36403ef7300c7d3a6281a9739619586b6b65c580070a15631f7cf43c",
    "codellama": "75a58be44276a72f36ee03b31e9e8852518031c4354faa211461f4c92348d8f3",
    "unigram": "355e362966af90e231197387d9334b95ffc1f303f23bc20dc34cb78c018272e2",
    "padded": "300d532eafecd8e93186db8f4b74d364a8f576ec271db2ab9b372d2d779c85b5",
}
"""vocab_digest of convert_hf_to_gguf.py's output (llama-cpp-python 0.3.36's vendored llama.cpp,
--outtype f32) for build(case), recorded by scripts/sp_vocab_golden.py; sentencepiece 0.2.3
trained the tokenizer.model files (TOKENIZER_SHA256 says they are the same bytes)."""
TOKENIZER_SHA256 = {
    "llama2": "28551d4c692ab36605979817300304617e8b3ab7cfbe57b6e7f4c51808193ab0",
    "unigram": "e17c36aa03c6c6fbf8cfd5b52f19cd21c91c7533bd537ee9c0d3224dc03e2cea",
}


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_vocabulary_is_the_converters(tmp_path: Path, case: str) -> None:
    """tokenizer.* keys byte-identical to the converter's: model llama, pre default, tokens,
    scores, types, special ids, add_bos/add_eos, chat template; [PADn] up to vocab_size,
    added tokens over the pieces with the converter's precedence and types."""
    src = build(tmp_path, case)
    if case in TOKENIZER_SHA256:  # the golden is only as good as the trained model
        model = (src / "tokenizer.model").read_bytes()
        assert sha256(model).hexdigest() == TOKENIZER_SHA256[case]
    reader = _export(src, tmp_path / "o.gguf")
    assert vocab_digest(reader) == GOLDEN[case]


def test_added_tokens_follow_the_converters_rules(tmp_path: Path) -> None:
    """What the padded golden holds, spelled out: a USER_DEFINED piece of the model is NORMAL,
    added_tokens.json's tokens are USER_DEFINED (score -1000), added_tokens_decoder overrides
    them (CONTROL when special or <|...|>, else USER_DEFINED with ▁ as a space), an added token
    past vocab_size is left out, ids no token has are [PADn] (UNUSED, score -10000)."""
    src = build(tmp_path, "padded")
    fields = _export(src, tmp_path / "o.gguf").fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    scores = fields["tokenizer.ggml.scores"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == len(scores) == len(types) == 416
    # <unk> is UNKNOWN in the model, CONTROL by added_tokens_decoder's "special": true
    assert (tokens[0], types[0], tokens[1], types[1]) == ("<unk>", 3, "<s>", 3)
    assert (tokens[3], types[3], scores[3]) == ("<ctl>", 3, -1000.0)  # was <0x00>, BYTE
    assert types[4] == 6 and tokens[4] == "<0x01>"
    assert (tokens[400], types[400], scores[400]) == ("<pad>", 4, -1000.0)
    assert (tokens[401], types[401]) == ("<tool call>", 4)
    assert (tokens[402], types[402]) == ("<|im_end|>", 3)
    assert (tokens[415], types[415], scores[415]) == ("[PAD415]", 5, -10000.0)
    assert "far" not in tokens
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 1  # config.json's
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 2


@pytest.mark.parametrize("case", ["llama2", "tinyllama", "padded"])
def test_transformers_reads_the_vocabulary_as_the_model_tokenizes(
    tmp_path: Path, case: str
) -> None:
    """transformers' GGUF tokenizer, built from the tokens, scores and types alone, gives the
    ids the checkpoint's own tokenizer (tokenizer.json, as transformers loads the directory)
    gives, with and without the special tokens it adds."""
    transformers = pytest.importorskip("transformers")
    src = build(tmp_path, case)
    _export(src, tmp_path / "o.gguf")
    got = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="o.gguf")
    want = transformers.AutoTokenizer.from_pretrained(src)
    for text in SAMPLES:
        for special in (False, True):
            ids = got(text, add_special_tokens=special).input_ids
            assert ids == want(text, add_special_tokens=special).input_ids, (text, special)


def test_trained_model_tokenizes_as_sentencepiece(tmp_path: Path) -> None:
    """The tiny tokenizer.json tokenizes as sentencepiece does (so the test above compares
    with the model's tokenizer, not with a stand-in), except where transformers' Llama
    tokenizer itself differs: a text that starts with a space."""
    transformers = pytest.importorskip("transformers")
    src = build(tmp_path, "llama2")
    hf = transformers.AutoTokenizer.from_pretrained(src)
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    for text in [t for t in SAMPLES if not t.startswith(" ")]:
        assert hf(text, add_special_tokens=False).input_ids == sp.encode(text), text


@pytest.mark.parametrize("case", ["llama2", "codellama"])
def test_cli_converts_a_sentencepiece_model_quietly(tmp_path: Path, case: str) -> None:
    """quantize HF_DIR --format gguf on a Llama 2 directory (tokenizer.model beside
    tokenizer.json, whose pair template gguf-py warns about on every Llama 2) and a CodeLlama
    one (the converter writes add_bos_token ... twice): exit 0, the vocabulary the float export
    writes, and none of gguf-py's log lines on stderr."""
    from tests.conftest import run_qtool

    src = build(tmp_path, case)
    out = tmp_path / "q.gguf"
    code, _, stderr = run_qtool("quantize", str(src), "--format", "gguf", "--dtype", "Q8_0",
                                "-o", str(out))  # fmt: skip
    assert code == 0, stderr
    for line in ("TemplateProcessing", "Duplicated key", "No handler"):
        assert line not in stderr, stderr
    if case == "llama2":  # (gguf-py takes seconds to read CodeLlama's 32,016 tokens again)
        assert vocab_digest(gguf.GGUFReader(out)) == GOLDEN[case]
