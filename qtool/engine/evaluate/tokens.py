"""The tokens both models run on: FLOAT's tokenizer on the text with its default special
tokens; QUANT's own tokenizer, when its directory has one, must give the same ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qtool.engine.evaluate import hf
from qtool.engine.evaluate.text import Text, sentences
from qtool.errors import InputError


def token_ids(tokenizer: Any, text: str, max_length: int | None = None) -> list[int]:
    """The tokenizer's ids of `text` with its default special tokens (cut to `max_length`)."""
    with hf.quiet():
        if max_length is None:
            return list(tokenizer(text)["input_ids"])
        return list(tokenizer(text, truncation=True, max_length=max_length)["input_ids"])


def causal_tokens(
    float_tok: Any, quant_tok: Any | None, text: Text, limit: int, quant: Path
) -> list[int]:
    """The ids of the whole text cut to `limit` tokens."""
    ids = token_ids(float_tok, text.content)[:limit]
    if len(ids) < 2:
        raise InputError(text.source, f"gives {len(ids)} token(s); eval needs at least 2")
    if quant_tok is not None:
        same_ids(ids, token_ids(quant_tok, text.content)[:limit], quant)
    return ids


def encoder_pieces(
    float_tok: Any, quant_tok: Any | None, text: Text, limit: int, ctx: int, quant: Path
) -> list[list[int]]:
    """The ids of the text's sentences (each cut to `ctx` tokens), in order, as long as their
    total stays within `limit` tokens (the first sentence always)."""
    pieces: list[list[int]] = []
    total = 0
    for sentence in sentences(text.content):
        ids = token_ids(float_tok, sentence, ctx)
        if pieces and total + len(ids) > limit:
            break
        if quant_tok is not None:
            same_ids(ids, token_ids(quant_tok, sentence, ctx), quant)
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
