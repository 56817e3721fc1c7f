"""compare's work grows linearly with the number of quantized modules of a compressed-tensors
export: the reader once looked up each module's tensors among every stored name (N modules,
N^2 name checks: 50,000 tiny tensors took 18x the CPU of 5,000, issue 33). Counted as the lines
of qtool's code executed (tests/reliability/test_scale.py's LineCounter), not timed."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from qtool import api
from qtool.numerics.packing import pack_to_int32
from tests.reliability.test_scale import GROWTH, LineCounter

SMALL = 100
LARGE = 10 * SMALL


def write_pair(root: Path, modules: int) -> tuple[Path, Path]:
    """A float model directory of `modules` Linear-shaped weights [1, 8] and its int4
    compressed-tensors export, per channel, written by hand."""
    float_dir, ct_dir = root / f"float{modules}", root / f"ct{modules}"
    float_dir.mkdir()
    ct_dir.mkdir()
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (modules, 1, 8), generator=gen, dtype=torch.int8)
    scale = torch.full((1, 1), 0.5, dtype=torch.bfloat16)
    weights, export = {}, {}
    for i in range(modules):
        weights[f"m{i}.weight"] = (codes[i].float() * 0.5 + 0.1).to(torch.bfloat16)
        export[f"m{i}.weight_packed"] = pack_to_int32(codes[i], 4)
        export[f"m{i}.weight_scale"] = scale.clone()
        export[f"m{i}.weight_shape"] = torch.tensor([1, 8])
    save_file(weights, float_dir / "model.safetensors")
    save_file(export, ct_dir / "model.safetensors")
    config = {"model_type": "tiny", "architectures": ["Tiny"]}
    (float_dir / "config.json").write_text(json.dumps(config))
    quantization = {
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "format": "pack-quantized",
        "ignore": [],
        "config_groups": {
            "group_0": {
                "targets": ["re:.*"],
                "format": "pack-quantized",
                "weights": {"num_bits": 4, "strategy": "channel", "symmetric": True,
                            "type": "int"},
            }
        },
    }  # fmt: skip
    (ct_dir / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    return float_dir, ct_dir


def test_compare_of_an_export_counts_linear_work(tmp_path: Path) -> None:
    lines = {}
    for n in (SMALL, LARGE):
        a, b = write_pair(tmp_path, n)
        with LineCounter() as counter:
            summary = api.compare(a, b)
        assert sum(r.compared for r in summary.rows) == n
        assert all("dequantized" in r.detail for r in summary.rows)
        lines[n] = counter.lines
    assert lines[LARGE] <= GROWTH * lines[SMALL], lines
