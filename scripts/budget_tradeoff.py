"""The size / SQNR trade-off of `--target-sqnr` on an all-MiniLM-L6-v2-shaped encoder.

Builds the model offline (6 layers, hidden 384, intermediate 1536, vocabulary 30522; random
weights with BERT's initialisation, normal std 0.02, seed 0; names as transformers' BertModel
saves them), quantizes it with examples/bert.toml at each target, and prints the table of
docs/recipes.md.

    python scripts/budget_tradeoff.py [--targets 20 30 45] [--workdir build/minilm]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from qtool import api
from qtool.api import QuantizeOptions
from qtool.spec import QSpec

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 384, 1536, 30522, 6
RECIPE = Path(__file__).resolve().parent.parent / "examples" / "bert.toml"
MIB = 1 << 20


def build(path: Path) -> None:
    """The float checkpoint (86.6 MiB in float32)."""
    g = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    def norm(prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": torch.ones(HIDDEN), f"{prefix}.bias": torch.zeros(HIDDEN)}

    def dense(prefix: str, n: int, k: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": weight(n, k), f"{prefix}.bias": torch.zeros(n)}

    t = {
        "embeddings.word_embeddings.weight": weight(VOCAB, HIDDEN),
        "embeddings.position_embeddings.weight": weight(512, HIDDEN),
        "embeddings.token_type_embeddings.weight": weight(2, HIDDEN),
        **norm("embeddings.LayerNorm"),
    }
    for layer in range(LAYERS):
        p = f"encoder.layer.{layer}"
        for name in ("query", "key", "value"):
            t |= dense(f"{p}.attention.self.{name}", HIDDEN, HIDDEN)
        t |= dense(f"{p}.attention.output.dense", HIDDEN, HIDDEN)
        t |= norm(f"{p}.attention.output.LayerNorm")
        t |= dense(f"{p}.intermediate.dense", INTERMEDIATE, HIDDEN)
        t |= dense(f"{p}.output.dense", HIDDEN, INTERMEDIATE)
        t |= norm(f"{p}.output.LayerNorm")
    t |= dense("pooler.dense", HIDDEN, HIDDEN)
    save_file(t, path)


def row(target: float, src: Path, workdir: Path) -> str:
    options = QuantizeOptions(QSpec(), recipe=api.load_recipe(RECIPE), target_sqnr=target)
    out = workdir / f"minilm.t{target:g}.safetensors"
    summary = api.quantize(src, out, options, device="cpu", force=True)
    weights = [r for r in summary.rows if r.name.endswith(".weight") and len(r.shape) == 2]
    kinds = Counter(_kind(r.detail, r.quantized) for r in weights)
    assert summary.overall is not None
    written = summary.bytes_out
    return (
        f"| {target:g} | {written / MIB:.1f} MiB | {100 * written / summary.bytes_in:.1f} % "
        f"| {summary.overall.sqnr_db:.1f} dB "
        f"| {kinds['int4']} / {kinds['int8']} / {kinds['float']} |"
    )


def _kind(detail: str, quantized: bool) -> str:
    if not quantized:
        return "float"
    return "int4" if re.match(r"\w+ int4", detail) else "int8"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=float, nargs="+", default=[20.0, 30.0, 45.0])
    parser.add_argument("--workdir", type=Path, default=Path("build/minilm"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.workdir / "model.safetensors"
    if not src.exists():
        build(src)
    print("| `--target-sqnr` | size | vs float | overall SQNR | weights int4 / int8 / float |")
    print("|---|---|---|---|---|")
    for target in args.targets:
        print(row(target, src, args.workdir))


if __name__ == "__main__":
    main()
