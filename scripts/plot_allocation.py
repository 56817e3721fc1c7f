"""Draw docs/images/allocation.png from scripts/allocation_table.py's JSON: size against measured
KL (uniform specs, --target-sqnr, --target-size, --target-kl in compressed-tensors; llama.cpp's
mixes and --target-size in GGUF; uniform and --target-size in the qtool format, which allocates
the tied embedding), one colour per eval text, and predicted against measured KL. Needs
matplotlib (the optional `plot` extra).

    python scripts/plot_allocation.py docs/images/allocation.json docs/images/allocation.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

MARKERS = {  # (family, format): marker, label
    ("uniform", "compressed-tensors"): ("o", "c-t uniform int4/int8"),
    ("target-sqnr", "compressed-tensors"): ("^", "c-t --target-sqnr"),
    ("target-size", "compressed-tensors"): ("s", "c-t --target-size"),
    ("target-kl", "compressed-tensors"): ("D", "c-t --target-kl"),
    ("by-hand", "compressed-tensors"): ("X", "c-t --target-size, int8 embedding (by hand)"),
    ("gguf-mix", "gguf"): ("v", "GGUF llama.cpp mixes"),
    ("gguf-target-size", "gguf"): ("P", "GGUF --target-size"),
    ("uniform", "qtool"): ("h", "qtool format int4 g64"),
    ("target-size", "qtool"): ("*", "qtool format --target-size"),
}
LINES = {"uniform", "gguf-mix"}  # families drawn as a curve through their points
COLOURS = ("tab:blue", "tab:orange", "tab:green")
MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    runs: dict[str, Any] = json.loads(args.data.read_text())["runs"]
    texts = sorted({t for r in runs.values() for t in r.get("measured", {})})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 6.2))
    for colour, text in zip(COLOURS, texts, strict=False):
        for (family, fmt), (marker, label) in MARKERS.items():
            for imatrix in (True, False):
                mine = [r for r in runs.values() if r["family"] == family and r["format"] == fmt
                        and r["imatrix"] is imatrix and text in r.get("measured", {})]  # fmt: skip
                if not mine:
                    continue
                mine.sort(key=lambda r: r["bytes"])
                name = f"{label}{'' if imatrix else ', no imatrix'}, {text}"
                fill = colour if imatrix else "none"
                left.semilogy([r["bytes"] / MIB for r in mine],
                              [r["measured"][text]["kl"] for r in mine],
                              marker + ("-" if family in LINES else ""), color=colour,
                              mfc=fill, label=name, ms=9 if fmt == "qtool" else 6,
                              lw=0.8)  # fmt: skip
                with_pred = [r for r in mine if r.get("predicted_kl")]
                right.loglog([r["predicted_kl"] for r in with_pred],
                             [r["measured"][text]["kl"] for r in with_pred], marker,
                             color=colour, mfc=fill)  # fmt: skip
    pairs = [(r["predicted_kl"], m["kl"]) for r in runs.values() if r.get("predicted_kl")
             for m in r.get("measured", {}).values()]  # fmt: skip
    if pairs:
        lo = min(min(p) for p in pairs) * 0.8
        hi = max(max(p) for p in pairs) * 1.25
        right.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = predicted")
        right.legend(fontsize=8)
    left.set_xlabel("size: tensor payload written, MiB")
    left.set_ylabel("mean KL(float || quantized), nats/token")
    left.set_title("size against measured KL", fontsize=10)
    left.legend(fontsize=6.5, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    right.set_xlabel("predicted KL (joint fit of sum alpha r)")
    right.set_ylabel("measured KL")
    right.set_title("predicted against measured (hollow: no imatrix, r from plain SQNR)",
                    fontsize=10)  # fmt: skip
    for ax in (left, right):
        ax.grid(True, which="both", lw=0.3, alpha=0.5)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_minor_formatter(NullFormatter())  # the minor ticks' labels overlap
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
