"""eval tokenizes only a prefix of the text, as long as the tokens asked for need (issue 28:
a 16 MB --text with --tokens 20 took 149 s and 7.9 GB tokenized whole), and must give exactly
the whole text's first ids. Checked with tokenizers trained here (GPT-2's byte-level BPE, whose
regex splits white-space runs; a sentencepiece-like Metaspace BPE; BERT's WordPiece with its
[SEP] at the end) on texts that cut badly: white-space runs, no white space at all, CRLF,
multi-byte characters. The prefixes start tiny here so that every text is cut many times."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from qtool.engine.model import tokens  # noqa: E402
from qtool.engine.model.hf import Tokenizer  # noqa: E402
from qtool.engine.model.text import default_text  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

CORPUS = default_text().content[:200_000]
TEXTS = {
    "prose": CORPUS[:30_000],
    "code": "def f(x):\n        return  x\t+ 1\r\n\r\n\n    # é ü 漢字 🙂\n" * 300,
    "spaces": ("word" + " " * 37 + "\n" * 5) * 400,
    "no-space": "abcdefghij漢字🙂" * 2_000,
    "one-char": "a" * 20_000,
}


def _trained(kind: str) -> Tokenizer:
    import transformers
    from tokenizers import Tokenizer as Rust
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    if kind == "wordpiece":
        rust = Rust(models.WordPiece(unk_token="[UNK]"))
        rust.normalizer = normalizers.BertNormalizer()
        rust.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer: Any = trainers.WordPieceTrainer(
            vocab_size=800, special_tokens=["[UNK]", "[CLS]", "[SEP]"]
        )
    else:
        rust = Rust(models.BPE())
        if kind == "byte-level":
            rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            rust.decoder = decoders.ByteLevel()
        else:
            rust.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.BpeTrainer(
            vocab_size=800, special_tokens=["<s>", "[CLS]", "[SEP]"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if kind == "byte-level" else [],
        )  # fmt: skip
    rust.train_from_iterator([CORPUS, *TEXTS.values()], trainer)
    first, last = ("[CLS]", " [SEP]") if kind == "wordpiece" else ("<s>", "")
    specials = [(t, rust.token_to_id(t)) for t in ("<s>", "[CLS]", "[SEP]") if t in first + last]
    rust.post_processor = processors.TemplateProcessing(
        single=f"{first} $A{last}", special_tokens=specials
    )
    backend = transformers.PreTrainedTokenizerFast(tokenizer_object=rust)  # type: ignore[no-untyped-call]
    return Tokenizer(backend, Path("tokenizer.json"))


@pytest.fixture(scope="module", params=["byte-level", "metaspace", "wordpiece"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return _trained(str(request.param))


@pytest.fixture(autouse=True)
def tiny_prefixes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens, "MIN_PREFIX", 8)
    monkeypatch.setattr(tokens, "CHARS_PER_TOKEN", 1)


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
@pytest.mark.parametrize("limit", [2, 20, 300, 3000])
def test_the_leading_ids_are_the_whole_texts(tokenizer: Tokenizer, text: str, limit: int) -> None:
    whole = tokenizer.ids(text)
    assert tokens.leading_ids(tokenizer, text, limit) == whole[:limit]


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
@pytest.mark.parametrize("limit", [3, 40, 500])
def test_truncated_ids_are_the_whole_texts_truncated(
    tokenizer: Tokenizer, text: str, limit: int
) -> None:
    """An encoder's sentence cut at --ctx tokens by the tokenizer (its closing [SEP] kept)."""
    assert tokens.leading_ids(tokenizer, text, limit, truncate=True) == tokenizer.ids(text, limit)


def test_a_prefix_is_all_that_is_tokenized(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the real first prefix (16 characters per token, at least 4,096), 20 tokens of a
    4 MB text cost a few prefixes of a few kB."""
    monkeypatch.undo()
    seen: list[int] = []
    ids = Tokenizer.ids

    def counting(self: Tokenizer, text: str, max_length: int | None = None) -> list[int]:
        seen.append(len(text))
        return ids(self, text, max_length)

    want = tokenizer.ids(TEXTS["prose"])[:20]
    monkeypatch.setattr(Tokenizer, "ids", counting)
    text = TEXTS["prose"] * 140  # 4.2 MB
    assert tokens.leading_ids(tokenizer, text, 20) == want
    assert sum(seen) < 40_000, seen
