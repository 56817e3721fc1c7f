"""A prototype of the calibrated error budget (issue 20, "Beyond"), measured on SmolLM2: each
Linear's candidate specs are judged by their OUTPUT SQNR on calibration tokens instead of their
weight SQNR, the cheapest candidate that reaches the target is kept, and the result is exported
and evaluated with `qtool eval` next to the weight-SQNR budget of the same size.

    output SQNR = 10 log10( tr(W H W^T) / tr(dW H dW^T) ),   H = X^T X over the calibration tokens

X are the Linear's inputs in the float model (forward hooks), dW = W - W_q with W_q the
candidate's reconstruction (scales rounded to bf16, as the compressed-tensors export stores
them). Calibration tokens are tokens 4096..4096+N of the default text: disjoint from the 4,096
that `qtool eval` scores. The chosen specs go to a recipe of one exact-name rule per Linear and
the export is `qtool quantize --format compressed-tensors --recipe`; nothing of qtool itself
changes. Run by hand after scripts/eval_smollm2.py (it reads that script's exports' sizes):

    python scripts/calibrated_budget.py --model /work/real/smollm2 --workdir build/smollm2 \\
        --weight-targets 20 20.5 [--calib-tokens 2048] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_smollm2 import CT, figures, run  # noqa: E402

from qtool.engine.model.text import default_text, windows  # noqa: E402
from qtool.numerics.kernels import dequantize, quantize_tensor  # noqa: E402
from qtool.spec import PerChannel, PerGroup, QSpec, RangeMethod, Scheme, StorageDtype  # noqa: E402

MSE = RangeMethod.MSE
CANDIDATES = {  # the ladder of eval_smollm2.py's weight budget
    "int4 g128 mse": QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(128), MSE),
    "int4 g64 mse": QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(64), MSE),
    "int8 channel": QSpec(Scheme.SYM, StorageDtype.INT8, PerChannel(0)),
}
EVAL_TOKENS = 4096


@dataclass(frozen=True)
class Option:
    label: str
    nbytes: int  # codes (int32 words) + bf16 scales, as the export stores them
    output_db: float
    weight_db: float


def calibration_inputs(model: Any, tokenizer: Any, count: int) -> dict[str, torch.Tensor]:
    """H = X^T X (float64, [K, K]) of every Linear of the decoder layers."""
    ids = tokenizer(default_text().content)["input_ids"][EVAL_TOKENS : EVAL_TOKENS + count]
    grams: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:

            def hook(m: Any, args: Any, out: Any, name: str = name) -> None:
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                grams[name] = grams.get(name, 0) + x.T @ x

            handles.append(module.register_forward_hook(hook))
    with torch.inference_mode():
        for s, e in windows(len(ids), 512):
            model(input_ids=torch.tensor([ids[s:e]]), use_cache=False)
    for h in handles:
        h.remove()
    return grams


def options(weight: torch.Tensor, gram: torch.Tensor) -> list[Option]:
    """Each storable candidate of one Linear with its cost and both SQNRs."""
    w = weight.float()
    n, k = w.shape
    signal_w, signal_o = float(w.double().square().sum()), float(_energy(w, gram))
    out = []
    for label, spec in CANDIDATES.items():
        group = spec.granularity.size if isinstance(spec.granularity, PerGroup) else k
        if k % group:
            continue  # compressed-tensors stores whole groups only
        q = quantize_tensor(w, spec, with_errors=False, scale_dtype=torch.bfloat16)
        rec = dequantize(q.q, q.scale, q.zero_point, spec, torch.bfloat16, (n, k)).float()
        dw = w - rec
        bits = spec.dtype.bits
        nbytes = n * math.ceil(k * bits / 32) * 4 + n * (k // group) * 2
        weight_db = 10 * math.log10(signal_w / float(dw.double().square().sum()))
        output_db = 10 * math.log10(signal_o / float(_energy(dw, gram)))
        out.append(Option(label, nbytes, output_db, weight_db))
    return sorted(out, key=lambda o: o.nbytes)


def _energy(w: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """tr(W H W^T) = sum((W H) * W)."""
    wd = w.double()
    return ((wd @ gram) * wd).sum()


def choose(table: dict[str, list[Option]], target: float, by: str = "output") -> dict[str, Option]:
    """The cheapest option whose output (or weight) SQNR reaches `target` (else the dearest)."""
    return {
        name: next((o for o in opts if getattr(o, f"{by}_db") >= target), opts[-1])
        for name, opts in table.items()
    }


def target_for_size(table: dict[str, list[Option]], nbytes: int) -> float:
    """The largest output-SQNR target whose choice takes at most `nbytes` (bisection)."""
    lo, hi = 0.0, 60.0
    for _ in range(40):
        mid = (lo + hi) / 2
        size = sum(o.nbytes for o in choose(table, mid).values())
        lo, hi = (mid, hi) if size <= nbytes else (lo, mid)
    return lo


def recipe(choice: dict[str, Option]) -> str:
    lines = []
    for key, option in choice.items():
        spec = CANDIDATES[option.label]
        size = spec.granularity.size if isinstance(spec.granularity, PerGroup) else None
        shape = f"group_size = {size}" if size else 'granularity = "channel"'
        for name in key.split("|")[1].split(","):
            lines += [
                "[[rule]]",
                f'match = "{name}.weight"',
                'scheme = "sym"',
                f'dtype = "{spec.dtype.value}"',
                shape,
                f'range = "{spec.range_method.value}"',
                "",
            ]
    return "\n".join(lines)


def measure(model_dir: Path, calib_tokens: int) -> dict[str, list[dict[str, Any]]]:
    """Every decoder Linear's options (as JSON-able dicts), from one calibration pass."""
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    grams = calibration_inputs(model.eval(), tokenizer, calib_tokens)
    weights = {n: m.weight.detach() for n, m in model.named_modules() if n in grams}
    return {n: [vars(o) for o in options(weights[n].bfloat16(), grams[n])] for n in grams}


FUSED = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
}


def fused(per_linear: dict[str, list[Option]]) -> dict[str, list[Option]]:
    """Linears vLLM fuses (q/k/v, gate/up) take one spec: a candidate reaches the target only
    if it does for every member (the min of their SQNRs), and costs their sum."""
    groups: dict[str, list[str]] = {}
    for name in per_linear:
        prefix, _, leaf = name.rpartition(".")
        groups.setdefault(f"{prefix}.{FUSED.get(leaf, leaf)}", []).append(name)
    out: dict[str, list[Option]] = {}
    for key, members in groups.items():
        labels = [o.label for o in per_linear[members[0]]]
        merged = []
        for label in labels:
            opts = [next(o for o in per_linear[m] if o.label == label) for m in members]
            nbytes = sum(o.nbytes for o in opts)
            output_db, weight_db = min(o.output_db for o in opts), min(o.weight_db for o in opts)
            merged.append(Option(label, nbytes, output_db, weight_db))
        out[key + "|" + ",".join(members)] = sorted(merged, key=lambda o: o.nbytes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="SmolLM2's HF directory")
    parser.add_argument("--workdir", type=Path, default=Path("build/smollm2"))
    parser.add_argument("--weight-targets", nargs="+", default=["20", "20.5"])
    parser.add_argument("--calib-tokens", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cached = args.workdir / f"calibration-{args.calib_tokens}.json"
    if not cached.exists():
        cached.write_text(json.dumps(measure(args.model, args.calib_tokens)))
    per_linear = {
        n: [Option(**o) for o in opts] for n, opts in json.loads(cached.read_text()).items()
    }
    table = fused(per_linear)
    results: dict[str, dict[str, Any]] = {}
    for weight_target in args.weight_targets:
        reference = f"qtool_target-sqnr_{weight_target}"  # eval_smollm2.py's weight budget
        ref_dir = args.workdir / reference
        budget = sum(o.nbytes for o in choose(table, float(weight_target), "weight").values())
        target = target_for_size(table, budget)
        choice = choose(table, target)
        out = args.workdir / f"calibrated_same_size_as_{weight_target}"
        (args.workdir / f"{out.name}.toml").write_text(recipe(choice))
        if not out.exists():
            rec = str(args.workdir / f"{out.name}.toml")
            run(["qtool", "quantize", str(args.model), *CT, "--recipe", rec, "-o", str(out)])
        counts: dict[str, int] = {}
        for key, o in choice.items():
            counts[o.label] = counts.get(o.label, 0) + len(key.split("|")[1].split(","))
        print(f"{out.name}: output-SQNR target {target:.2f} dB, {counts}", file=sys.stderr)
        results[reference] = figures(args.model, ref_dir, args)
        results[out.name] = figures(args.model, out, args)
    for name, doc in results.items():
        c = doc["causal"]
        print(
            f"| {name} | {doc['bytes'] / (1 << 20):.1f} MiB | {doc['weight_sqnr_db']:.2f} dB | "
            f"{c['perplexity_quant']:.2f} | {c['kl']['mean']:.4f} | {c['top1_agreement']:.1%} |"
        )
    print(json.dumps({n: d["causal"]["kl"]["mean"] for n, d in results.items()}))


if __name__ == "__main__":
    main()
