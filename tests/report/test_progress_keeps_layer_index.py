"""The progress bar names the tensor being processed; at 80 columns it had 16 characters and cut
every name in the middle, keeping the part that is the same in every row and dropping the layer
number, the part a user watches ('model…roj.weight' for each of SmolLM2's 30 down_proj and
o_proj; issue 33 polish). Now the number is kept whatever the width, and the bar itself is
narrower below 100 columns so that most names show whole from it on."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.progress import Progress

from qtool.report import console

NAMES = [
    "model.layers.11.self_attn.q_proj.weight",
    "model.layers.12.mlp.down_proj.weight",
    "model.layers.29.post_attention_layernorm.weight",
    "encoder.layer.3.attention.output.LayerNorm.bias",
    "blk.12.ffn_down.weight",
    "layers.0.fc1.weight",
]


@pytest.mark.parametrize("width", [12, 16, 20, 26, 40])
@pytest.mark.parametrize("name", NAMES)
def test_a_cut_name_keeps_its_layer_number(name: str, width: int) -> None:
    number = next(part for part in name.split(".") if part.isdigit())
    shown = console._middle_cut(name, width)
    assert len(shown) <= width
    assert f"{number}." in shown or shown.startswith(f"…{number}"), shown


def test_at_80_columns_the_name_and_its_module_fit() -> None:
    """The bar at 80 columns: 26 characters of name, which hold SmolLM2's Linears from the
    layer number on."""
    out = io.StringIO()
    bar = console._BarProgress(_progress(out), 80)
    assert bar._name_width == 26
    assert console._middle_cut("model.layers.12.mlp.down_proj.weight", 26) == (
        "…12.mlp.down_proj.weight"
    )
    assert console._middle_cut("model.layers.12.self_attn.o_proj.weight", 26) == (
        "…12.self_attn.o_proj"
    )


def test_a_name_without_a_number_keeps_its_start_and_end() -> None:
    assert console._middle_cut("model.embed_tokens.weight", 16) == "model…ens.weight"
    assert console._middle_cut("model.norm.weight", 40) == "model.norm.weight"


def _progress(out: io.StringIO) -> Progress:
    return Progress(console=Console(file=out, width=80), disable=True)
