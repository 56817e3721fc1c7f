"""llm-compressor's GPTQ (or AWQ) int4 group 64 on a Llama-family model directory, calibrated on
exactly the token windows a `qtool quantize --method` run used (scripts/method_windows.py),
written as a compressed-tensors directory that `qtool eval` reads.

Usage: python scripts/peer_llmcompressor.py MODEL_DIR WINDOWS.json OUT_DIR [--awq] [--asym]
                                            [--streams fit,held] [--samples N]
Runs in llm-compressor's own environment (docs/calibration.md, "The peer on the same windows":
llm-compressor 0.14 installed with --no-deps beside qtool's torch and transformers), not in
qtool's. `--streams`: which of the windows' streams calibrate it (default fit,held: every
calibration window qtool's run took; fit alone is what qtool's solve saw). `--samples`: the
first N windows only (AWQ's search is slow). `--asym`: affine int4 (llm-compressor's
`symmetric=False`, a zero point per group). Symmetric int4, groups of 64, act-order by
decreasing diag H with static groups (qtool's layout: no g_idx), dampening 0.01, lm_head
ignored. By hand only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("windows", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--awq", action="store_true")
    parser.add_argument("--asym", action="store_true")
    parser.add_argument("--streams", default="fit,held")
    parser.add_argument("--samples", type=int, default=None)
    args = parser.parse_args()

    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    found = json.loads(args.windows.read_text())
    ids: list[list[int]] = [w for s in args.streams.split(",") for w in found[s]]
    ids = ids[: args.samples] if args.samples else ids
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(w) for w in ids]})
    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=not args.asym, strategy="group", group_size=64
    )
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    recipe: Any
    if args.awq:
        from llmcompressor.modifiers.awq import AWQModifier
        from llmcompressor.pipelines.cache import IntermediatesCache

        if not torch.cuda.is_available():  # 0.14 pins its cache for the GPU: fails on a CPU
            IntermediatesCache.pin_memory = lambda *_, **__: None

        recipe = AWQModifier(config_groups=groups, ignore=["lm_head"])
    else:
        from llmcompressor.modifiers.quantization import GPTQModifier

        recipe = GPTQModifier(
            config_groups=groups, ignore=["lm_head"], dampening_frac=0.01, actorder="static"
        )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    start = time.perf_counter()
    oneshot(
        model=model, dataset=dataset, recipe=recipe, max_seq_length=found["ctx"],
        num_calibration_samples=len(ids),
    )  # fmt: skip
    seconds = time.perf_counter() - start
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    print(f"{args.out}: {len(ids)} windows of {found['ctx']} tokens, {seconds:.0f} s in oneshot")


if __name__ == "__main__":
    main()
