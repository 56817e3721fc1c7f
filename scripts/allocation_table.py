"""Issue 32's proof on a real model: size against measured KL for uniform specs, `--target-sqnr`,
`--target-size` and `--target-kl` (compressed-tensors); llama.cpp's mixes (Q8_0 to Q2_K) and
`--target-size` at Q3_K_M's, Q4_K_M's and Q5_K_M's sizes (GGUF); uniform int4 g64 against
`--target-size` at its size in the qtool format, which allocates the tied embedding (the
compressed-tensors export keeps it float); each with the predicted KL next to the measured one.
Run by hand (not in CI: it needs the model, an imatrix with sensitivities and saved logits):

    qtool calibrate MODEL -o IMATRIX --sensitivity --sensitivity-tokens 512 --ctx 512 --tokens 4096
    qtool eval MODEL --save-logits pydoc.logits                      # eval's default text
    qtool eval MODEL --text /usr/share/common-licenses/GPL-3 --save-logits gpl.logits
    qtool calibrate MODEL -o PLAIN --ctx 512 --tokens 4096   # the same h, without alpha
    python scripts/allocation_table.py --model MODEL --imatrix PLAIN --sens IMATRIX \\
        --workdir build/alloc --logits pydoc=pydoc.logits --logits GPL-3=gpl.logits \\
        [--only NAME ...] [--plan NAME=RECIPE] [--cached]
    python scripts/plot_allocation.py build/alloc/allocation.json docs/images/allocation.png

scripts/embedding_row.py adds one more record to the same workdir (the embedding int8, made by
hand: qtool's compressed-tensors export keeps it float); --cached collects it too.

The runs without a target need only h (PLAIN, which can run while the slow sensitivity pass
does; its h must equal IMATRIX's), the targets and every prediction need IMATRIX; --cached
rebuilds allocation.json and table.md from what the workdir holds.

Every step is a qtool command (printed before it runs); each run's quantize JSON and each
eval's JSON are kept in the workdir, so an interrupted run resumes; allocation.json collects
the figures. Sizes are quantize's `totals.bytes_out` (the tensor payload; in the qtool format
the codes plus the sidecar's qparams, what --target-size counts). qtool eval reads every format's
output directly (a GGUF and a qtool-format directory too). The predicted KL of
every run with the imatrix is the file's joint fit of S = sum over the tensors with an alpha of
alpha x r, r = 10^(-weighted SQNR / 10) from quantize's own rows (the allocation's r: the same
weighted error); for an allocation it equals the plan's `sum_alpha_r`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qtool.formats.gguf.names import gguf_names
from qtool.formats.imatrix import read_imatrix_file
from qtool.formats.imatrix.sensitivity import Sensitivities, read_sensitivities


@dataclass
class Run:
    name: str
    family: str  # uniform, target-sqnr, target-size, target-kl, gguf-mix, gguf-target-size
    flags: list[str] | Callable[[dict[str, Any]], list[str]]
    imatrix: bool = True
    fmt: str = "compressed-tensors"  # --format: compressed-tensors, qtool or gguf
    extra: dict[str, Any] = field(default_factory=dict)


def size_of(name: str, extra: list[str] | None = None) -> Callable[[dict[str, Any]], list[str]]:
    """--target-size at the bytes an earlier run wrote."""
    return lambda done: ["--target-size", str(done[name]["bytes"]), *(extra or [])]


def between(a: str, b: str, lad: list[str]) -> Callable[[dict[str, Any]], list[str]]:
    """--target-size halfway between the bytes of two earlier runs."""
    return lambda done: ["--target-size", str((done[a]["bytes"] + done[b]["bytes"]) // 2), *lad]


def runs(ladder: Path | None) -> list[Run]:
    lad = [] if ladder is None else ["--recipe", str(ladder)]
    return [
        Run("int4 g64 mse", "uniform", ["--dtype", "int4", "--group-size", "64", "--range", "mse"]),
        Run("--target-size = int4 g64", "target-size", size_of("int4 g64 mse", lad)),
        Run("Q4_K_M", "gguf-mix", ["--dtype", "Q4_K_M"], imatrix=False, fmt="gguf"),
        Run("Q4_K_M --imatrix", "gguf-mix", ["--dtype", "Q4_K_M"], fmt="gguf"),
        Run("--target-size = Q4_K_M", "gguf-target-size", size_of("Q4_K_M"), imatrix=False,
            fmt="gguf"),
        Run("--target-size = Q4_K_M --imatrix", "gguf-target-size", size_of("Q4_K_M"),
            fmt="gguf"),
        # the imatrix plans, the codes unweighted: against the mix without one
        Run("--target-size = Q4_K_M --imatrix-use plan", "gguf-target-size",
            size_of("Q4_K_M", ["--imatrix-use", "plan"]), fmt="gguf"),
        # the qtool format allocates the tied embedding (compressed-tensors keeps it float)
        Run("int4 g64 mse (qtool)", "uniform", ["--dtype", "int4", "--group-size", "64",
                                                "--range", "mse"], fmt="qtool"),  # fmt: skip
        Run("--target-size = int4 g64 (qtool)", "target-size",
            size_of("int4 g64 mse (qtool)", lad), fmt="qtool"),
        # llama.cpp's mixes (qtool writes them byte-identical to llama-quantize's), the imatrix
        *(Run(f"{t} --imatrix", "gguf-mix", ["--dtype", t], fmt="gguf")
          for t in ("Q8_0", "Q6_K", "Q5_K_M", "Q3_K_M", "Q2_K")),
        Run("--target-size = Q3_K_M --imatrix", "gguf-target-size", size_of("Q3_K_M --imatrix"),
            fmt="gguf"),
        Run("--target-size = Q5_K_M --imatrix", "gguf-target-size", size_of("Q5_K_M --imatrix"),
            fmt="gguf"),
        Run("--target-size = Q2_K --imatrix", "gguf-target-size", size_of("Q2_K --imatrix"),
            fmt="gguf"),
        Run("--target-kl 0.3", "target-kl", ["--target-kl", "0.3", *lad]),
        Run("--target-kl 0.15", "target-kl", ["--target-kl", "0.15", *lad]),
        Run("--target-kl 0.45", "target-kl", ["--target-kl", "0.45", *lad]),
        Run("int4 channel mse", "uniform", ["--dtype", "int4", "--range", "mse"]),
        Run("int4 g32 mse", "uniform", ["--dtype", "int4", "--group-size", "32", "--range", "mse"]),
        Run("int8 channel", "uniform", ["--dtype", "int8", "--range", "mse"]),
        # K = 576 (q/k/v/o, gate/up) is no multiple of 128: those per channel
        Run("int4 g128 mse", "uniform", ["--dtype", "int4", "--group-size", "128", "--range",
                                         "mse", "--group-fallback", "channel"]),  # fmt: skip
        Run("--target-size = int4 channel", "target-size", size_of("int4 channel mse", lad)),
        Run("--target-size = int4 g32", "target-size", size_of("int4 g32 mse", lad)),
        Run("--target-size = mid int4 channel..g64", "target-size",
            between("int4 channel mse", "int4 g64 mse", lad)),
        Run("--target-size = mid int4 g32..int8", "target-size",
            between("int4 g32 mse", "int8 channel", lad)),
        # the SQNR budget weighs no trial by h yet (quantize refuses --imatrix with it)
        Run("--target-sqnr 20", "target-sqnr", ["--target-sqnr", "20"], imatrix=False),
        Run("--target-sqnr 21", "target-sqnr", ["--target-sqnr", "21"], imatrix=False),
    ]  # fmt: skip


def run(cmd: list[str]) -> str:
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, text=True, capture_output=True)
    if done.returncode not in (0, 3):
        sys.exit(f"failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def quantize(args: Any, r: Run, done: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    out = args.workdir / (slug(r.name) + (".gguf" if r.fmt == "gguf" else ""))
    saved = args.workdir / f"{slug(r.name)}.quantize.json"
    if not saved.exists():
        flags = r.flags(done) if callable(r.flags) else r.flags
        target = r.family.startswith("target-") or r.family == "gguf-target-size"
        imx = ["--imatrix", str(args.sens if target else args.imatrix)] if r.imatrix else []
        text = run([args.qtool, "quantize", str(args.model), "--format", r.fmt, *flags, *imx,
                    "-o", str(out), "--threads", str(args.threads), "--json",
                    "--force"])  # fmt: skip
        saved.write_text(text)
    return out, json.loads(saved.read_text())


def predicted(doc: dict[str, Any], sens: Sensitivities, hf_to_gguf: dict[str, str]) -> float:
    """S = sum alpha x r over the quantized tensors with an alpha (r from the weighted SQNR, else
    from the plain SQNR: the allocation's r)."""
    total = 0.0
    for row in doc["tensors"]:
        alpha = sens.alpha.get(hf_to_gguf.get(row["name"], row["name"]))
        # a tensor the imatrix has no entry for (the embedding): h = 1, as the allocation takes it
        db = row.get("weighted_sqnr_db", row.get("sqnr_db"))
        if row.get("quantized") and alpha is not None and db is not None:
            total += alpha * 10 ** (-float(db) / 10)
    return total


def evaluate(args: Any, name: str, path: Path) -> dict[str, Any]:
    """The run's eval figures on every --logits text (one eval each, kept in the workdir)."""
    out = {}
    for item in args.logits:
        label, _, logits = item.partition("=")
        saved = args.workdir / f"{slug(name)}.eval-{label}.json"
        if not saved.exists() and args.cached:
            continue
        if not saved.exists():
            cmd = [args.qtool, "eval", str(args.model), str(path), "--logits", logits]
            saved.write_text(run([*cmd, "--threads", str(args.threads), "--json"]))
        doc = json.loads(saved.read_text())
        causal = doc.get("candidates", [doc])[0]["causal"]
        out[label] = {
            "kl": causal["kl"]["mean"],
            "kl_p99": causal["kl"]["p99"],
            "top1": causal["top1_agreement"],
            "ppl": causal["perplexity_quant"],
            "ppl_float": causal["perplexity_float"],
            "ln_ppl_ratio": causal["ln_ppl_ratio"],
        }
    return out


def record(r: Run, doc: dict[str, Any], sens: Sensitivities | None) -> dict[str, Any]:
    names = [row["name"] for row in doc["tensors"]]
    blocks = 1 + max((int(n.split(".")[2]) for n in names if n.startswith("model.layers.")),
                     default=-1)  # fmt: skip
    s = None
    if (r.imatrix or r.family == "target-sqnr") and sens is not None:  # r from the plain SQNR
        s = predicted(doc, sens, gguf_names("llama", blocks, names))
    alloc = doc.get("allocation")
    keys = ("target", "predicted_loss", "loss", "sum_alpha_r", "by_spec", "measured_kl")
    return {
        "family": r.family,
        "format": r.fmt,
        "imatrix": r.imatrix,
        "bytes": doc["totals"]["bytes_out"],
        "sum_alpha_r": s,
        "predicted_kl": None if s is None or sens is None else sens.predicted(s),
        "allocation": None if alloc is None else {k: alloc.get(k) for k in keys},
        "by_spec": doc["totals"]["by_spec"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--imatrix", type=Path, required=True, help="h for the uniform runs")
    ap.add_argument("--sens", type=Path, help="the same imatrix with sensitivities (calibrate "
                    "--sensitivity): the targets' --imatrix and every prediction; without it "
                    "only the runs that need no alpha")  # fmt: skip
    ap.add_argument("--workdir", type=Path, default=Path("build/alloc"))
    ap.add_argument("--logits", action="append", default=[], help="LABEL=FILE (eval --save-logits)")
    ap.add_argument("--ladder", type=Path, help="a recipe with `ladder = [...]` for the targets")
    ap.add_argument("--only", action="append", help="run only these (names as in the table)")
    ap.add_argument("--plan", action="append", default=[], help="NAME=RECIPE: also run this "
                    "plan (ladder_gain.py --save-recipe) as a target-size")  # fmt: skip
    saved_only = (
        "run nothing: records from the workdir's saved JSON (predictions once --sens exists)"
    )
    ap.add_argument("--cached", action="store_true", help=saved_only)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--qtool", default=str(Path(sys.executable).parent / "qtool"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    sens = None
    if args.sens is not None:
        sens = read_sensitivities(args.sens, read_imatrix_file(args.sens).metadata)
        if sens is None:
            sys.exit(f"{args.sens} has no sensitivities: calibrate with --sensitivity")
    plans = [Run(n, "target-size", ["--recipe", f]) for n, _, f in
             (p.partition("=") for p in args.plan)]  # fmt: skip
    for r in [*runs(args.ladder), *plans]:
        needs_alpha = r.imatrix and r.family in ("target-size", "target-kl", "gguf-target-size")
        if (args.only and r.name not in args.only) or (needs_alpha and sens is None):
            continue
        if args.cached and not (args.workdir / f"{slug(r.name)}.quantize.json").exists():
            continue
        done = {}  # the runs quantized so far (by this or another invocation): their bytes
        for other in runs(args.ladder):
            saved = args.workdir / f"{slug(other.name)}.quantize.json"
            if saved.exists():
                done[other.name] = {"bytes": json.loads(saved.read_text())["totals"]["bytes_out"]}
        path, doc = quantize(args, r, done)
        rec = {"name": r.name, **record(r, doc, sens), "measured": evaluate(args, r.name, path)}
        (args.workdir / f"{slug(r.name)}.record.json").write_text(json.dumps(rec, indent=1))
        collect(args, sens)


def collect(args: Any, sens: Sensitivities | None) -> None:
    """allocation.json: every run's record in the workdir, in the table's order."""
    order = [r.name for r in runs(None)]
    recs = [json.loads(p.read_text()) for p in args.workdir.glob("*.record.json")]
    recs.sort(key=lambda v: order.index(v["name"]) if v["name"] in order else len(order))
    out = {
        "setup": {
            "model": str(args.model),
            "imatrix": str(args.imatrix),
            "sens": str(args.sens),
            "sensitivity_tokens": None if sens is None else sens.tokens,
            "joint_fit": None if sens is None else sens.joint,
            "logits": args.logits,
            "threads": args.threads,
        },
        "runs": {v.pop("name"): v for v in recs},
    }
    (args.workdir / "allocation.json").write_text(json.dumps(out, indent=1) + "\n")
    (args.workdir / "table.md").write_text(table(out["runs"]))


def table(runs: dict[str, Any]) -> str:
    """The docs' table: size, predicted and measured KL, top-1 agreement per eval text."""
    texts = list(dict.fromkeys(t for v in runs.values() for t in v.get("measured", {})))
    head = ["run", "format", "size (bytes)", "predicted KL"]
    head += [f"KL {t}" for t in texts] + [f"top-1 {t}" for t in texts]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, v in runs.items():
        m = v.get("measured", {})
        pred = "-" if v["predicted_kl"] is None else f"{v['predicted_kl']:.3f}"
        fmt = {"gguf": "GGUF", "qtool": "qtool"}.get(v["format"], "c-t")
        cells = [name, fmt, f"{v['bytes']:,}", pred]
        cells += [f"{m[t]['kl']:.4f}" if t in m else "-" for t in texts]
        cells += [f"{m[t]['top1']:.1%}" if t in m else "-" for t in texts]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
