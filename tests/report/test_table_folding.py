"""Tables at 80 columns (issue 33 polish, round 3): inspect split shapes across lines
("[49152," / "576]") while names stayed whole, and quantize's table folded every description
over 2-4 lines ("sym int4 group" / "64 (576x24" / "groups)") to keep the names whole. Shapes
now never fold, and the cells a table must lose are split between the names and the
descriptions as leaves it fewest lines."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from qtool import api
from qtool.report import layout
from qtool.report.layout import Column
from qtool.spec import PerGroup, QSpec, StorageDtype
from tests.conftest import Invoke

# SmolLM2's decoder block, as quantize's table names and describes it (int4 group 64)
BLOCK = [
    ("input_layernorm.weight", "kept: 1-D (bias/norm)"),
    ("mlp.down_proj.weight", "sym int4 group 64 (576x24 groups)"),
    ("mlp.gate_proj.weight", "sym int4 group 64 (1536x9 groups)"),
    ("mlp.up_proj.weight", "sym int4 group 64 (1536x9 groups)"),
    ("post_attention_layernorm.weight", "kept: 1-D (bias/norm)"),
    ("self_attn.k_proj.weight", "sym int4 group 64 (192x9 groups)"),
    ("self_attn.o_proj.weight", "sym int4 group 64 (576x9 groups)"),
    ("self_attn.q_proj.weight", "sym int4 group 64 (576x9 groups)"),
    ("self_attn.v_proj.weight", "sym int4 group 64 (192x9 groups)"),
]


def test_quantize_table_at_80_columns_takes_at_most_two_lines_a_row() -> None:
    """Taking every cell from the descriptions gave 3 lines a row, every cell from the names
    folded every name; a few from each keeps every row to 2 lines or fewer."""
    rows = [("model.embed_tokens.weight", "kept: tied to the output head (float at 4 bits)")]
    rows += [(f"model.layers.{i}.{n}", d) for i in range(30) for n, d in BLOCK]
    columns = [
        Column("tensor", [(n, "") for n, _ in rows], fold=12, names=True),
        Column("dtype", [("BF16→I4", "") for _ in rows]),
        Column("quantization", [(d, "") for _, d in rows], fold=16),
        Column("SQNR dB", [("19.3", "") for _ in rows], right=True),
    ]
    lines = ["".join(t for t, _ in line) for line in layout.table(columns, 80).lines][3:-1]
    assert all(layout.cell_width(line) <= 80 for line in lines)
    assert len(lines) <= 2 * len(rows)
    # quantized rows: the spec on one line, the groups on the next; most names whole
    assert sum("sym int4 group 64" in line for line in lines) == 30 * 7
    assert sum(name in "\n".join(lines) for name, _ in rows) > len(rows) // 2


def test_inspect_keeps_shapes_whole_at_80_columns(invoke: Invoke, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.layers.0.post_attention_layernorm.weight": (12345, 64),
              "model.layers.0.self_attn.q_proj.weight": (128, 576)}  # fmt: skip
    tensors = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    save_file(tensors, tmp_path / "m.safetensors")
    options = api.QuantizeOptions(QSpec(dtype=StorageDtype.INT4, granularity=PerGroup(64)))
    api.quantize(tmp_path / "m.safetensors", tmp_path / "q.safetensors", options)
    code, out, err = invoke("inspect", str(tmp_path / "q.safetensors"), env={"COLUMNS": "80"})
    assert code == 0, err
    table = [line for line in out.splitlines() if "[" in line or "]" in line]
    assert len(table) == len(shapes) and all("[" in t and "]" in t for t in table), out
