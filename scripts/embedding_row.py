"""Issue 32's lever qtool's compressed-tensors export does not pull: what the allocation reaches at
uniform int4 g64's size when the input embedding (SmolLM2: tied, 56.6 MB bf16, half the file)
is int8 per channel and the bytes it frees go to the Linears. qtool cannot write that file (its
loaders cannot load a quantized embedding: tests/interop/test_ct_quantized_embedding.py), so it
is made here by hand and measured through qtool's own reader:

1. `qtool quantize --target-size B + saved` (the Linears get the budget they would have);
2. the embedding replaced by int8 per channel pack-quantized tensors (qtool's encoder, as the
   export writes a Linear) and a config group naming it, so the file holds B bytes at most;
3. `qtool dequantize` into a float directory (transformers cannot load step 2's), then `qtool
   eval` on each --logits text; a record for allocation_table.py's --cached collect.

    python scripts/embedding_row.py --model /tmp/A/dith --sens dith.imatrix.gguf \\
        --budget 113098656 --workdir build/alloc --logits pydoc=pydoc.logits \\
        --logits GPL-3=gpl.logits
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qtool.formats.compressed_tensors.codec import encode_weight
from qtool.formats.compressed_tensors.config import weights_args
from qtool.formats.compressed_tensors.selection import PACK_QUANTIZED, output_nbytes
from qtool.formats.compressed_tensors.selection import Selection as CtSelection
from qtool.formats.imatrix import read_imatrix_file
from qtool.formats.imatrix.sensitivity import read_sensitivities
from qtool.io.stformat import TensorEntry
from qtool.spec import QSpec, as_grid, parse_spec_label

EMBED = "model.embed_tokens"
NAME = "--target-size = int4 g64, int8 embedding (by hand)"
SPEC = "int8 channel"


def run(cmd: list[str]) -> str:
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, text=True, capture_output=True)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def embedding_bytes(shape: tuple[int, int], dtype: str) -> tuple[int, int]:
    """(float bytes, int8-per-channel bytes) of the embedding as the export would write it."""
    n, k = shape
    entry = TensorEntry(f"{EMBED}.weight", dtype, shape, 0, n * k * 2)
    stored = output_nbytes(CtSelection(entry, EMBED, grid()))
    return output_nbytes(CtSelection(entry, None, None)), stored


def grid() -> QSpec:
    return as_grid(parse_spec_label(SPEC, writable=True))


def with_int8_embedding(src: Path, dst: Path) -> float:
    """`src` (a compressed-tensors export) with its embedding int8 per channel; returns its r."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    weight = tensors.pop(f"{EMBED}.weight")
    spec = grid()
    encoded = encode_weight(weight, spec)
    tensors.update({f"{EMBED}.{k}": v for k, v in encoded.tensors.items()})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    doc = json.loads((src / "config.json").read_text())
    q = doc["quantization_config"]
    group = {"targets": [EMBED], "weights": weights_args(spec), "input_activations": None,
             "output_activations": None, "format": PACK_QUANTIZED}  # fmt: skip
    q["config_groups"] = {"group_embedding": group, **q["config_groups"]}
    (dst / "config.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    x = weight.double()
    restored = restore(encoded.tensors, spec).double()
    return float((x - restored).square().sum() / x.square().sum())


def restore(tensors: dict[str, torch.Tensor], spec: QSpec) -> torch.Tensor:
    from qtool.formats.compressed_tensors.codec import dequantize_module
    from qtool.formats.compressed_tensors.config import parse_args

    args = parse_args("embedding", weights_args(spec), PACK_QUANTIZED)
    return dequantize_module(tensors, args, PACK_QUANTIZED)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--sens", type=Path, required=True, help="imatrix with sensitivities")
    ap.add_argument("--budget", type=int, required=True, help="uniform int4 g64's bytes_out")
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--logits", action="append", default=[], help="LABEL=FILE (eval --save-logits)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--qtool", default=str(Path(sys.executable).parent / "qtool"))
    args = ap.parse_args()
    wd = args.workdir
    wd.mkdir(parents=True, exist_ok=True)
    n, k = load_file(args.model / "model.safetensors")[f"{EMBED}.weight"].shape
    dense, int8 = embedding_bytes((n, k), "BF16")
    linears, mixed, flat = wd / "emb-linears", wd / "emb-int8", wd / "emb-int8-float"
    saved = wd / "emb-linears.quantize.json"
    if not saved.exists():
        size = str(args.budget + dense - int8)
        saved.write_text(run([args.qtool, "quantize", str(args.model), "--format",
                              "compressed-tensors", "--target-size", size, "--imatrix",
                              str(args.sens), "-o", str(linears), "--threads", str(args.threads),
                              "--json", "--force"]))  # fmt: skip
    doc = json.loads(saved.read_text())
    r = with_int8_embedding(linears, mixed)
    shutil.rmtree(flat, ignore_errors=True)
    flat.mkdir()
    for f in mixed.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, flat / f.name)
    shutil.copy(args.model / "config.json", flat / "config.json")
    run([args.qtool, "dequantize", str(mixed), "-o", str(flat / "model.safetensors")])
    sens = read_sensitivities(args.sens, read_imatrix_file(args.sens).metadata)
    assert sens is not None
    s = doc["allocation"]["sum_alpha_r"] + sens.alpha["token_embd.weight"] * r
    measured = {}
    for item in args.logits:
        label, _, logits = item.partition("=")
        kept = wd / f"emb-int8.eval-{label}.json"  # kept: an interrupted run resumes
        if not kept.exists():
            kept.write_text(run([args.qtool, "eval", str(args.model), str(flat), "--logits",
                                 logits, "--threads", str(args.threads), "--json"]))  # fmt: skip
        out = kept.read_text()
        causal = json.loads(out).get("candidates", [json.loads(out)])[0]["causal"]
        measured[label] = {"kl": causal["kl"]["mean"], "kl_p99": causal["kl"]["p99"],
                           "top1": causal["top1_agreement"], "ppl": causal["perplexity_quant"],
                           "ppl_float": causal["perplexity_float"],
                           "ln_ppl_ratio": causal["ln_ppl_ratio"]}  # fmt: skip
    record = {
        "name": NAME,
        "family": "by-hand",
        "format": "compressed-tensors",
        "imatrix": True,
        "bytes": doc["totals"]["bytes_out"] - dense + int8,
        "sum_alpha_r": s,
        "predicted_kl": sens.predicted(s),
        "allocation": {**doc["allocation"], "embedding": {"spec": SPEC, "bytes": int8, "r": r}},
        "measured": measured,
    }
    (wd / "emb-int8.record.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record[k] for k in ("bytes", "sum_alpha_r", "predicted_kl", "measured")}))


if __name__ == "__main__":
    main()
