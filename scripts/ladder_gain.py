"""How much a ladder lets the allocation gain, by its own predicted KL, without quantizing again:
from ONE `qtool quantize --dry-run --estimate --json` over a superset ladder (every candidate of
every decided tensor is in its `trials`, with bytes and -10 log10 r), solve the allocation for
sub-ladders at a byte budget with qtool's own solver (numerics/allocate.py) and compare each
plan's S = sum alpha x r with uniform plans'. Fused siblings (compressed-tensors' q/k/v and
gate/up) are one item, one spec for all, as quantize's allocation makes them.

    qtool quantize MODEL --format compressed-tensors --imatrix IMATRIX --recipe super.toml \\
        --target-size SIZE --dry-run --estimate --json > trials.json
    python scripts/ladder_gain.py trials.json IMATRIX --budget-of "int4 g64 mse" \\
        [--ladder NAME='label; label; ...' ...] [--extrapolate]

--extrapolate adds grids qtool cannot write (int3/int5/int6 at the same granularities), each
r = the int4 candidate's r x 4^(4 - bits) (6.02 dB per bit, the uniform-quantizer rule: an
estimate, not a measurement) and bytes = codes at that width + the int4 candidate's scales.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from qtool.engine.allocate import _grid_keys, _toml_str, exact_pattern
from qtool.formats.gguf.names import gguf_names
from qtool.formats.imatrix import read_imatrix_file
from qtool.formats.imatrix.sensitivity import read_sensitivities
from qtool.numerics.allocate import Candidate, TensorLadder, within_bytes
from qtool.spec import QSpec, parse_spec_label

FUSED = re.compile(r"^(.*\.)(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.weight$")


def group_of(name: str) -> str:
    """compressed-tensors' fused siblings share one spec: q/k/v of a block, gate/up of a block."""
    m = FUSED.match(name)
    if m is None:
        return name
    return m.group(1) + ("qkv" if "attn" in m.group(2) else "gate_up")


def items(doc: dict[str, Any], alpha: dict[str, float]) -> dict[str, dict[str, tuple[int, float]]]:
    """group -> label -> (bytes, sum of alpha x r over the group's tensors)."""
    names = [t["name"] for t in doc["tensors"]]
    blocks = 1 + max(int(n.split(".")[2]) for n in names if n.startswith("model.layers."))
    llama = gguf_names("llama", blocks, names)
    out: dict[str, dict[str, list[float]]] = defaultdict(dict)
    counts: dict[str, int] = defaultdict(int)
    for t in doc["tensors"]:
        trials = (t.get("decided_by") or {}).get("trials")
        if not trials or llama.get(t["name"]) not in alpha:
            continue
        a = alpha[llama[t["name"]]]
        g = group_of(t["name"])
        counts[g] += 1
        for trial in trials:
            r = 10 ** (-float(trial["sqnr_db"]) / 10)
            acc = out[g].setdefault(trial["spec"], [0.0, 0.0, 0.0])
            acc[0] += trial["bytes"]
            acc[1] += a * r
            acc[2] += 1
    return {g: {lab: (int(v[0]), v[1]) for lab, v in labs.items() if v[2] == counts[g]}
            for g, labs in out.items()}  # fmt: skip


def extrapolated(found: dict[str, dict[str, tuple[int, float]]], values: dict[str, int]) -> None:
    """Add int3/int5/int6 of every int4 candidate (see the module's doc), in place."""
    for g, labs in found.items():
        for lab, (nbytes, s) in list(labs.items()):
            if " int4 " not in f" {lab} ":
                continue
            codes = values[g] // 2  # int4 codes: half a byte per value
            for bits in (3, 5, 6):
                extra = values[g] * bits // 8 - codes
                labs[lab.replace("int4", f"int{bits}")] = (nbytes + extra, s * 4.0 ** (4 - bits))


def recipe(doc: dict[str, Any], chosen: dict[str, Candidate]) -> str:
    """One rule per decided tensor pinning the spec its group got (quantize's --save-recipe
    form), the tensors in the dry run's order."""
    lines = ["# scripts/ladder_gain.py: one rule per tensor the plan decided", ""]
    for t in doc["tensors"]:
        c = chosen.get(group_of(t["name"]))
        if c is None:
            continue
        lines += ["[[rule]]", f"match = {_toml_str(exact_pattern(t['name']))}"]
        if c.label == "float":
            lines.append('keep = "allocation: float"')
        else:
            spec = parse_spec_label(
                re.sub(r"group (\d+)", r"g\1", c.label).replace("axis 0", "channel")
            )
            assert isinstance(spec, QSpec)
            lines += _grid_keys(spec)
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trials", type=Path)
    ap.add_argument("imatrix", type=Path)
    ap.add_argument("--budget-of", default="sym int4 group 64 mse")
    ap.add_argument("--ladder", action="append", default=[])
    ap.add_argument("--extrapolate", action="store_true")
    ap.add_argument("--save-recipe", action="append", default=[],
                    help="NAME=FILE: ladder NAME's plan as a recipe")  # fmt: skip
    args = ap.parse_args()
    doc = json.loads(args.trials.read_text())
    found_imx = read_imatrix_file(args.imatrix)
    sens = read_sensitivities(args.imatrix, found_imx.metadata)
    assert sens is not None
    found = items(doc, dict(sens.alpha))
    values: dict[str, int] = {}
    for t in doc["tensors"]:
        g = group_of(t["name"])
        n = 1
        for d in t["shape"]:
            n *= d
        values[g] = values.get(g, 0) + n
    if args.extrapolate:
        extrapolated(found, values)
    labels = sorted({lab for labs in found.values() for lab in labs})
    print("candidates:", "; ".join(labels))
    base = args.budget_of
    budget = sum(labs[base][0] for labs in found.values())
    uniform = sum(labs[base][1] for labs in found.values())
    kl = sens.predicted(uniform)
    print(f"uniform {base}: {budget} bytes, S {uniform:.4f}, predicted KL {kl:.4f}")
    ladders = {"all": labels}
    for spec in args.ladder:
        name, _, text = spec.partition("=")
        ladders[name] = [s.strip() for s in text.split(";")]
    for name, ladder in ladders.items():
        tls = [TensorLadder(g, tuple(Candidate(lab, *labs[lab]) for lab in ladder if lab in labs))
               for g, labs in sorted(found.items())]  # fmt: skip
        plan = within_bytes(tls, budget)
        used = sorted({c.label for c in plan.chosen})
        p = sens.predicted(plan.loss)
        print(f"{name}: {plan.nbytes} bytes, S {plan.loss:.4f} ({plan.loss / uniform - 1:+.1%}), "
              f"predicted KL {p:.4f} ({p / kl - 1:+.1%}); uses {used}")  # fmt: skip
        for item in args.save_recipe:
            which, _, path = item.partition("=")
            if which == name:
                chosen = dict(zip(plan.names, plan.chosen, strict=True))
                Path(path).write_text(recipe(doc, chosen))
                print(f"wrote {path}")


if __name__ == "__main__":
    main()
