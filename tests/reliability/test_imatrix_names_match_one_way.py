"""How an imatrix's entry names meet the checkpoint's: llama.cpp's names are mapped only through
the model's config.json (a lone .safetensors has none: its tensors match exact names only, and an
imatrix naming none of them is refused naming the file and the directory to give, never with
the name map's "general.architecture is 'None'"); an entry held under both llama.cpp's name and
the checkpoint's is refused naming both instead of one winning silently; entries naming no
tensor of the input (another model's blocks) are one note."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qtool.engine.importance import Provenance, match_importance
from qtool.errors import InputError
from qtool.numerics.imatrix import ImportanceMatrix, MatrixStats

pytest.importorskip("gguf")

HF = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"]
CONFIG = {"model_type": "llama", "num_hidden_layers": 1}
PATH = Path("m.imatrix.gguf")


def _stats() -> MatrixStats:
    return MatrixStats(np.ones((1, 4), np.float32), np.array([1], np.int64))


def _match(names: list[str], config: dict[str, object] | None):  # type: ignore[no-untyped-def]
    imatrix = ImportanceMatrix({n: _stats() for n in names}, 512, 1, ("t.txt",))
    provenance = Provenance(str(PATH), "0" * 64, (), len(names), 1, 512)
    return match_importance(PATH, (imatrix, provenance), HF, config)


@pytest.mark.parametrize("config", [None, {}, {"model_type": None}, {"model_type": 3}])
def test_llama_names_without_a_model_type_are_refused_naming_the_file(
    config: dict[str, object] | None,
) -> None:
    with pytest.raises(InputError) as info:
        _match(["blk.0.attn_q.weight"], config)
    line = str(info.value)
    assert line.startswith(f"{PATH}: names none of the input's tensors"), line
    assert "config.json" in line and "None" not in line, line


def test_exact_names_match_without_a_config() -> None:
    importance = _match([HF[0], "blk.0.ffn_down.weight"], None)
    assert list(importance.stats) == [HF[0]]
    assert importance.unused == ("blk.0.ffn_down.weight",)


def test_llama_names_map_with_the_config() -> None:
    importance = _match(["blk.0.attn_q.weight", "blk.0.ffn_down.weight"], CONFIG)
    assert sorted(importance.stats) == sorted(HF) and importance.unused == ()


def test_one_tensor_under_both_names_is_refused_naming_both() -> None:
    with pytest.raises(InputError) as info:
        _match([HF[0], "blk.0.attn_q.weight"], CONFIG)
    line = str(info.value)
    assert line.startswith(f"{PATH}: tensor {HF[0]!r}: "), line
    assert "blk.0.attn_q.weight" in line and "keep one" in line, line


def test_entries_for_blocks_the_model_lacks_are_one_note() -> None:
    extra = [f"blk.{b}.attn_q.weight" for b in range(1, 6)]
    importance = _match(["blk.0.attn_q.weight", *extra], CONFIG)
    assert importance.unused == tuple(extra)
    notes = importance.check([])
    assert len(notes) == 1 and "5 of 6 entries" in notes[0] and extra[0] in notes[0], notes
