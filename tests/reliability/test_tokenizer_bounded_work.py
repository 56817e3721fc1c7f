"""A text without white space (one 5 MB "word") reached the tokenizer whole, at about 500 bytes
of memory per character (a 12 MB line died under a memory limit): the text given to the
tokenizer at once is bounded by what the tokens asked for need, white space or not. (Inside a
run of over tokens.RUN characters without white space the ids are the cut text's: BPE on one
such "word" depends on its whole length, which only tokenizing all of it tells.)"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from qtool.engine.model import tokens  # noqa: E402
from qtool.engine.model.hf import Tokenizer  # noqa: E402
from tests.eval.test_eval_tokens import TEXTS, _trained  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
@pytest.mark.parametrize("run", [TEXTS["one-char"][:1000], TEXTS["no-space"][:1000]])
def test_a_text_without_white_space_is_tokenized_in_prefixes(
    kind: str, run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = _trained(kind)
    seen: list[int] = []
    ids = Tokenizer.ids

    def counting(self: Tokenizer, text: str, max_length: int | None = None) -> list[int]:
        seen.append(len(text))
        return ids(self, text, max_length)

    monkeypatch.setattr(Tokenizer, "ids", counting)
    text = run * 4000  # 4 MB or more, not one white-space character
    got = tokens.leading_ids(tokenizer, text, 20)
    assert len(got) == 20
    assert max(seen) <= 2 * tokens.MIN_PREFIX + tokens.RUN, seen
