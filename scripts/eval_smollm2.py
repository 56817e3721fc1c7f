"""Real figures for docs/eval.md: qtool's compressed-tensors exports of SmolLM2-135M-Instruct
(int8 per channel, int4 g128/g64 min-max and mse, the --target-sqnr budget at two targets) and
llm-compressor's `model_free_ptq` exports of the same schemes, each evaluated with `qtool eval`
against the float model on the same tokens. Run by hand (not in CI: it needs the model and, for
the comparison, llm-compressor in its own environment):

    python scripts/eval_smollm2.py --model /work/real/smollm2 --workdir build/smollm2 \\
        [--llmc-python /tmp/eval/llmc/bin/python] [--tokens 4096] [--ctx 512] [--threads 1]

Every step is a qtool command (printed before it runs); results are cached in the workdir as
JSON, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

CT = ["--format", "compressed-tensors"]
FALLBACK = ["--group-fallback", "channel"]
LADDER = 'ladder = ["int4 g128 mse", "int4 g64 mse", "int8 channel"]\n'
QTOOL: dict[str, list[str]] = {
    "qtool int8 channel": ["--dtype", "int8"],
    # K = 576 (q/k/v/o, gate/up) is no multiple of 128: those per channel, down_proj g128
    "qtool int4 g128 minmax": ["--dtype", "int4", "--group-size", "128", *FALLBACK],
    "qtool int4 g128 mse": ["--dtype", "int4", "--group-size", "128", "--range", "mse", *FALLBACK],
    "qtool int4 g64 minmax": ["--dtype", "int4", "--group-size", "64"],
    "qtool int4 g64 mse": ["--dtype", "int4", "--group-size", "64", "--range", "mse"],
}
BUDGETS = ("20", "20.5")  # 21 and above: every tensor int8 (int4 g64 mse reaches ~20.5 dB)
# (no g128: model_free_ptq refuses groups that do not divide K = 576)
LLMC: dict[str, tuple[int, str, int | None]] = {
    "llm-compressor int8 channel": (8, "channel", None),
    "llm-compressor int4 g64": (4, "group", 64),
}
LLMC_PROGRAM = """
import sys
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import model_free_ptq
bits, strategy, group, src, out = sys.argv[1:6]
args = QuantizationArgs(num_bits=int(bits), type="int", symmetric=True, strategy=strategy,
                        group_size=int(group) if group != "none" else None)
scheme = QuantizationScheme(targets=["Linear"], weights=args)
# embed_tokens too: model_free_ptq quantizes it otherwise, and transformers cannot load that
model_free_ptq(src, out, scheme=scheme, ignore=["lm_head", "re:.*embed_tokens.*"], device="cpu")
"""
MIB = 1 << 20


def run(cmd: list[str], capture: bool = False) -> str:
    """The command's stdout (shown on stderr, but for its last line, unless `capture`)."""
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE)
    if not capture:
        print(*done.stdout.splitlines()[-2:], sep="\n", file=sys.stderr)
    return done.stdout


def export_qtool(model: Path, workdir: Path) -> dict[str, Path]:
    out = {}
    recipe = workdir / "ladder.toml"
    recipe.write_text(LADDER)
    jobs = dict(QTOOL)
    for target in BUDGETS:
        jobs[f"qtool --target-sqnr {target}"] = ["--recipe", str(recipe), "--target-sqnr", target]
    for name, flags in jobs.items():
        target_dir = workdir / name.replace(" ", "_").replace("--", "")
        if not target_dir.exists():
            run(["qtool", "quantize", str(model), *CT, *flags, "-o", str(target_dir)])
        out[name] = target_dir
    return out


def export_llmc(model: Path, workdir: Path, python: str | None) -> dict[str, Path]:
    out: dict[str, Path] = {}
    if python is None:
        return out
    for name, (bits, strategy, group) in LLMC.items():
        target = workdir / name.replace(" ", "_")
        if not target.exists():
            args = [str(bits), strategy, str(group or "none"), str(model), str(target)]
            run([python, "-c", LLMC_PROGRAM, *args])
        out[name] = target
    return out


def figures(model: Path, quant: Path, args: argparse.Namespace) -> dict[str, Any]:
    cached = quant.with_name(quant.name + ".eval.json")
    if not cached.exists():
        threads = ["--threads", str(args.threads)] if args.threads else []
        flags = ["--tokens", str(args.tokens), "--ctx", str(args.ctx), *threads]
        doc = json.loads(run(["qtool", "eval", str(model), str(quant), "--per-layer", "--json",
                              *flags], capture=True))  # fmt: skip
        compared = json.loads(run(["qtool", "compare", str(model), str(quant), "--json"], True))
        doc["weight_sqnr_db"] = compared["totals"]["sqnr_db"]
        cached.write_text(json.dumps(doc))
    result: dict[str, Any] = json.loads(cached.read_text())
    result["bytes"] = sum(p.stat().st_size for p in quant.glob("*.safetensors"))
    return result


def table(model: Path, results: dict[str, dict[str, Any]]) -> str:
    float_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    first = next(iter(results.values()))
    c0 = first["causal"]
    lines = [
        f"{first['tokens']:,} tokens of {first['text']['source']} (sha256 "
        f"{first['text']['sha256'][:12]}), windows of {first['ctx']}, {first['dtype']}; float: "
        f"{float_bytes / MIB:.1f} MiB, perplexity {c0['perplexity_float']:.2f}",
        "",
        "| export | size | weight SQNR | perplexity | KL mean | KL p99 | top-1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, doc in results.items():
        c = doc["causal"]
        lines.append(
            f"| {name} | {doc['bytes'] / MIB:.1f} MiB | {doc['weight_sqnr_db']:.2f} dB | "
            f"{c['perplexity_quant']:.2f} | {c['kl']['mean']:.4f} | {c['kl']['p99']:.3f} | "
            f"{c['top1_agreement'] * 100:.1f} % |"
        )
    lines += ["", "Five worst layers by output SQNR (weight SQNR -> output SQNR, dB):", ""]
    for name, doc in results.items():
        worst = sorted(doc["layers"], key=lambda r: r["output_sqnr_db"])[:5]
        cells = [f"`{r['name']}` {r['weight_sqnr_db']:.1f} -> {r['output_sqnr_db']:.1f}"
                 for r in worst]  # fmt: skip
        lines.append(f"- {name}: " + "; ".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="SmolLM2's HF directory")
    parser.add_argument("--workdir", type=Path, default=Path("build/smollm2"))
    parser.add_argument("--llmc-python", default=None)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    exports = export_qtool(args.model, args.workdir)
    exports |= export_llmc(args.model, args.workdir, args.llmc_python)
    results = {name: figures(args.model, path, args) for name, path in exports.items()}
    print(table(args.model, results))


if __name__ == "__main__":
    main()
