"""The tokens both models run on: FLOAT's tokenizer on the text with its default special
tokens; QUANT's own tokenizer, when its directory has one, must give the same ids.

Only as much text reaches a tokenizer as the tokens asked for need (a 16 MB --text with
--tokens 20 took 149 s and 7.9 GB when tokenized whole): `leading_ids` tokenizes prefixes of
doubling length, each ending before white space, and stops once two of them agree on the tokens
wanted, SLACK tokens or more before the shorter one's end, so that the text after the cut
cannot change them. The ids are the whole text's (tests/eval/test_eval_tokens.py compares them
on ordinary and adversarial texts); a tokenizer whose early tokens depend on text far ahead is
given longer prefixes, up to the whole text."""

from __future__ import annotations

import re
from pathlib import Path

from qtool.engine.model.hf import Tokenizer
from qtool.engine.model.text import Text, iter_sentences
from qtool.errors import InputError

CHARS_PER_TOKEN = 16
"""The first prefix: this many characters per token wanted (real tokenizers give 2 to 5 per
token on prose; 16 leaves room for code and long words), and at least MIN_PREFIX."""
MIN_PREFIX = 4096
SLACK = 16
"""Tokens beyond those wanted that a prefix must give: the last ones may be a word cut in two,
or special tokens closing the sequence."""
RUN = 65536
"""The farthest a prefix looks for white space to end before; a text with none that near (one
5 MB word cost 2.7 GB given whole to a BPE tokenizer) is cut inside the run, where the two
prefixes' agreement still decides that the cut changes none of the tokens wanted."""
_SPACE = re.compile(r"\s")


def leading_ids(tokenizer: Tokenizer, text: str, limit: int, truncate: bool = False) -> list[int]:
    """The first `limit` ids of `text` (truncate: the ids of `text` truncated to `limit` by the
    tokenizer, special tokens kept), as the whole text gives them. A prefix ends before white
    space within RUN characters (a word cut in two may tokenize otherwise, WordPiece makes a long
    word [UNK]), else inside the run."""
    size = max(MIN_PREFIX, CHARS_PER_TOKEN * limit)
    previous: list[int] | None = None
    while size < len(text):
        found = _SPACE.search(text, size, size + RUN)
        end = found.start() if found else size  # no white space near: cut inside the run
        prefix = text[:end]
        ids = tokenizer.ids(prefix)
        far = previous is not None and len(previous) >= limit + SLACK
        if far and ids[:limit] == (previous or [])[:limit]:  # what follows changes nothing
            return tokenizer.ids(prefix, limit) if truncate else ids[:limit]
        previous = ids
        size = max(2 * size, found.end() if found else end + 1)
    return tokenizer.ids(text, limit if truncate else None)[:limit]


def causal_tokens(
    float_tok: Tokenizer, quant_tok: Tokenizer | None, text: Text, limit: int, quant: Path
) -> list[int]:
    """The ids of the whole text cut to `limit` tokens."""
    ids = leading_ids(float_tok, text.content, limit)
    if len(ids) < 2:
        raise InputError(text.source, f"gives {len(ids)} token(s); eval needs at least 2")
    if quant_tok is not None:
        same_ids(ids, leading_ids(quant_tok, text.content, limit), quant)
    return ids


def encoder_pieces(
    float_tok: Tokenizer,
    quant_tok: Tokenizer | None,
    text: Text,
    limit: int,
    ctx: int,
    quant: Path,
) -> list[list[int]]:
    """The ids of the text's sentences (each cut to `ctx` tokens), in order, as long as their
    total stays within `limit` tokens (the first sentence always)."""
    pieces: list[list[int]] = []
    total = 0
    for sentence in iter_sentences(text.content):
        ids = leading_ids(float_tok, sentence, ctx, truncate=True)
        if pieces and total + len(ids) > limit:
            break
        if quant_tok is not None:
            same_ids(ids, leading_ids(quant_tok, sentence, ctx, truncate=True), quant)
        pieces.append(ids)
        total += len(ids)
    if not pieces:
        raise InputError(text.source, "holds no sentence (no letter or digit); give some text")
    return pieces


def same_ids(ours: list[int], theirs: list[int], quant: Path) -> None:
    if ours == theirs:
        return
    at = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
        min(len(ours), len(theirs)),
    )
    got = theirs[at] if at < len(theirs) else "nothing"
    want = ours[at] if at < len(ours) else "nothing"
    raise InputError(
        quant, f"QUANT's tokenizer differs from FLOAT's: at token {at} of the text it gives "
        f"{got} where FLOAT's gives {want}; evaluate models that share a tokenizer",
    )  # fmt: skip


def check_vocabulary(pieces: list[list[int]], rows: int, tokenizer: Tokenizer) -> None:
    """InputError naming the tokenizer's file when it gives an id the model's embedding has no
    row for (an added token beyond the vocabulary: the embedding lookup would fail inside
    torch with "index out of range")."""
    wrong = next((i for ids in pieces for i in ids if not 0 <= i < rows), None)
    if wrong is not None:
        raise InputError(
            tokenizer.source, f"gives token id {wrong} on the text, but the model's vocabulary "
            f"has {rows:,} entries (ids 0 to {rows - 1:,}); the tokenizer does not belong to "
            "these weights",
        )  # fmt: skip
