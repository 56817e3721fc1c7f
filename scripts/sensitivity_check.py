"""The linear model of calibrate --sensitivity on a real model (docs/calibration.md): predicted KL
(sum over the blocks' Linears of alpha_L r_L, r_L from the importance matrix) against the KL
`qtool eval` measures, for uniform specs and mixed plans (recipes), on eval's default text and
on another text. Run by hand (not in CI: it needs the model and an imatrix with sensitivities):

    qtool calibrate MODEL -o build/sens/model.imatrix.gguf --sensitivity --threads 1
    python scripts/sensitivity_check.py --model MODEL --imatrix build/sens/model.imatrix.gguf \\
        --workdir build/sens [--text /usr/share/common-licenses/GPL-3] [--tokens 1024]

Only the blocks' Linears are quantized (`*_proj.weight`), round to nearest, so that the model's
loss comes from what the prediction sums. Every step is a qtool command (printed before it
runs); its results are kept in the workdir as JSON, so an interrupted run resumes. Writes
table.md and, with matplotlib, predicted_vs_measured.png there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from qtool.formats.imatrix import hf_names_of, read_imatrix_file
from qtool.formats.imatrix.sensitivity import read_sensitivities
from qtool.numerics.allocate import relative_error

LINEARS = ["--include", "*_proj.weight"]
ATTN, MLP = r"re:.*\.self_attn\..*_proj\.weight", r"re:.*\.mlp\..*_proj\.weight"
PLANS: dict[str, list[str] | str] = {
    "int8 channel": ["--dtype", "int8"],
    "int4 g32": ["--dtype", "int4", "--group-size", "32"],
    "int4 g64": ["--dtype", "int4", "--group-size", "64"],
    "int4 channel": ["--dtype", "int4"],
    # mixed plans: recipes (attention and MLP at different specs)
    "attn int8, mlp int4 g32": (
        f"[[rule]]\nmatch = '{ATTN}'\ndtype = 'int8'\ngranularity = 'channel'\n"
        f"[[rule]]\nmatch = '{MLP}'\ndtype = 'int4'\ngroup_size = 32\n"
    ),
    "attn int4 g64, mlp int8": (
        f"[[rule]]\nmatch = '{ATTN}'\ndtype = 'int4'\ngroup_size = 64\n"
        f"[[rule]]\nmatch = '{MLP}'\ndtype = 'int8'\ngranularity = 'channel'\n"
    ),
}


def run(cmd: list[str]) -> str:
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode not in (0, 3):
        sys.exit(f"failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name)


def quantized(qtool: str, model: Path, work: Path, name: str, how: list[str] | str) -> Path:
    out = work / slug(name)
    if out.exists():
        return out
    args = how
    if isinstance(how, str):
        recipe = work / f"{slug(name)}.toml"
        recipe.write_text(how)
        args = ["--recipe", str(recipe)]
    run([qtool, "quantize", str(model), "-o", str(out), *LINEARS, *args, "--threads", "1"])
    return out


def predicted(qtool: str, model: Path, q: Path, imatrix: Path, work: Path) -> dict[str, float]:
    """sum alpha_L r_L (S), the file's joint fit of it (S when the file has none) and the
    Linears' count, for the quantized file `q`."""
    deq = work / f"{q.name}.deq.safetensors"
    if not deq.exists():
        run([qtool, "dequantize", str(q), "-o", str(deq)])
    found = read_imatrix_file(imatrix)
    sens = read_sensitivities(imatrix, found.metadata)
    if sens is None:
        sys.exit(f"{imatrix} has no sensitivities: calibrate with --sensitivity")
    floats = load_file(str(next(model.glob("*.safetensors"))))
    approx = load_file(str(deq))
    blocks = 1 + max(int(n.split(".")[1]) for n in found.imatrix.entries)
    names = hf_names_of(found.imatrix, "llama", blocks, list(floats))
    total, linears = 0.0, 0
    for gguf_name, hf_name in names.items():
        h = torch.from_numpy(found.imatrix.entries[gguf_name].mean_squares()[0].copy())
        w = floats[hf_name].float()
        r = relative_error(w, approx[hf_name].float(), h)
        total += sens.alpha[gguf_name] * r
        linears += 1
    return {"predicted": total, "fitted": sens.predicted(total), "linears": linears}


def measured(
    qtool: str, model: Path, qs: list[Path], text: Path | None, args: Any, saved: Path
) -> list[float]:
    """Mean KL of each of `qs` from one `qtool eval` (its JSON kept in `saved`)."""
    if not saved.exists():
        cmd = [qtool, "eval", str(model), *map(str, qs), "--json", "--tokens", str(args.tokens),
               "--ctx", str(args.ctx), "--threads", str(args.threads)]  # fmt: skip
        if text is not None:
            cmd += ["--text", str(text)]
        saved.write_text(run(cmd))
    doc = json.loads(saved.read_text())
    return [float(r["causal"]["kl"]["mean"]) for r in doc.get("candidates", [doc])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--imatrix", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, default=Path("build/sens"))
    ap.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--qtool", default=str(Path(sys.executable).parent / "qtool"))
    args = ap.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "results.json"
    results: dict[str, Any] = json.loads(cache.read_text()) if cache.exists() else {}
    files = {n: quantized(args.qtool, args.model, work, n, how) for n, how in PLANS.items()}
    for label, text in (("default", None), (args.text.name, args.text)):
        if any(label not in results.get(n, {}) for n in files):
            saved = work / f"eval-{label}.json"
            kls = measured(args.qtool, args.model, list(files.values()), text, args, saved)
            for name, kl in zip(files, kls, strict=True):
                results.setdefault(name, {})[label] = kl
            cache.write_text(json.dumps(results, indent=1))
    for name, q in files.items():
        if "fitted" not in results[name]:
            results[name] |= predicted(args.qtool, args.model, q, args.imatrix, work)
            cache.write_text(json.dumps(results, indent=1))
    table = [f"| plan | S | predicted KL (fit) | measured KL, eval default text | measured KL, "
             f"{args.text.name} |", "|---|---|---|---|---|"]  # fmt: skip
    for name in files:
        r = results[name]
        table.append(f"| {name} | {r['predicted']:.4f} | {r['fitted']:.4f} | {r['default']:.4f} | "
                     f"{r[args.text.name]:.4f} |")  # fmt: skip
    (work / "table.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    plot(results, list(files), args.text.name, work / "predicted_vs_measured.png")


def plot(results: dict[str, Any], names: list[str], other: str, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no plot)")
        return
    fig, ax = plt.subplots(figsize=(5, 5))
    for label, marker in (("default", "o"), (other, "s")):
        xs = [results[n]["fitted"] for n in names]
        ys = [results[n][label] for n in names]
        ax.loglog(xs, ys, marker, label=f"measured on {label}")
    lo = min(min(results[n][k] for n in names) for k in ("fitted", "default", other))
    hi = max(max(results[n][k] for n in names) for k in ("fitted", "default", other))
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = predicted")
    ax.set_xlabel("predicted KL (the joint fit of sum alpha r), nats/token")
    ax.set_ylabel("measured KL (qtool eval), nats/token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
