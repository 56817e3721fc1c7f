"""SmolLM2-135M-Instruct through `qtool quantize --format gguf`, loaded by the real consumers:
the table of docs/gguf.md ("A real model").

Input: the float GGUF that llama.cpp's converter writes from the Hugging Face directory. It is
not made here (the converter is not a qtool dependency); with llama-cpp-python 0.3.36's sdist
unpacked in SDIST and sentencepiece importable:

    PYTHONPATH=SDIST/vendor/llama.cpp/gguf-py python SDIST/vendor/llama.cpp/convert_hf_to_gguf.py \\
        /work/real/smollm2 --outtype bf16 --outfile build/smol/smol-bf16.gguf

For each GGUF type (and each --target-sqnr mix), the script runs the command, then reads the file
with gguf-py's GGUFReader and loads it with transformers (`from_pretrained(dir,
gguf_file=...)`, accelerate installed), and compares the model's logits on a fixed English
text with the float Hugging Face model's (float32): SQNR of the logits, largest difference,
top-1 agreement, and the perplexity of the text. The float GGUF is the first row, so the
loader's own difference shows. Needs torch, transformers, accelerate and gguf.

    python scripts/gguf_smollm2.py build/smol/smol-bf16.gguf --hf /work/real/smollm2
        [--types Q8_0 Q6_K Q4_K Q4_0] [--target-sqnr 24 30] [--workdir build/smol]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the "
    "tower from 1887 to 1889. Locally nicknamed the Iron Lady, it was constructed as the "
    "centrepiece of the 1889 World's Fair, and to crown the centennial anniversary of the "
    "French Revolution. Although initially criticised by some of France's leading artists and "
    "intellectuals for its design, it has since become a global cultural icon of France and "
    "one of the most recognisable structures in the world."
)


def quantize(src: Path, out: Path, args: list[str]) -> tuple[float, float]:
    """`qtool quantize SRC --format gguf -o OUT ARGS`: (seconds, overall SQNR in dB)."""
    cmd = [sys.executable, "-m", "qtool", "quantize", str(src), "--format", "gguf",
           "-o", str(out), "--force", "--json", *args]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return seconds, float(json.loads(done.stdout)["totals"]["sqnr_db"])


def file_figures(path: Path) -> tuple[int, float, str]:
    """gguf-py reads the file: (tensors, bits per weight over all tensors, types by count)."""
    import gguf

    reader = gguf.GGUFReader(path)
    nbytes = sum(int(t.n_bytes) for t in reader.tensors)
    numel = sum(int(t.n_elements) for t in reader.tensors)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    types = " ".join(f"{k}:{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    return len(reader.tensors), 8 * nbytes / numel, types


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0].float()  # type: ignore[no-any-return]


def versus(logits: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor) -> dict[str, float]:
    """SQNR of `logits` against `ref`, largest difference, top-1 agreement, perplexity."""
    err = (logits - ref).pow(2).sum()
    sqnr = float("inf") if err == 0 else float(10 * torch.log10(ref.pow(2).sum() / err))
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:])
    return {
        "sqnr": sqnr,
        "max_diff": float((logits - ref).abs().max()),
        "top1": float((logits.argmax(-1) == ref.argmax(-1)).float().mean() * 100),
        "ppl": float(torch.exp(nll)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("float_gguf", type=Path)
    parser.add_argument("--hf", type=Path, required=True, help="SmolLM2's HF directory")
    parser.add_argument("--types", nargs="*", default=["Q8_0", "Q6_K", "Q4_K", "Q4_0"])
    parser.add_argument("--target-sqnr", type=float, nargs="*", default=[24.0, 30.0])
    parser.add_argument("--workdir", type=Path, default=Path("build/smol"))
    a = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    a.workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(a.hf)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.float32)
    ref = logits_of(hf, ids)
    base = versus(ref, ref, ids)
    print(f"HF float model: {ids.shape[1]} tokens, perplexity {base['ppl']:.3f}, "
          f"load {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    runs: list[tuple[str, Path, list[str] | None]] = [("float GGUF", a.float_gguf, None)]
    runs += [(t, a.workdir / f"smol-{t}.gguf", ["--dtype", t]) for t in a.types]
    for db in a.target_sqnr:
        mix = ["--target-sqnr", f"{db:g}"]
        runs.append((f"mix (--target-sqnr {db:g})", a.workdir / f"smol-mix{db:g}.gguf", mix))
    header = ("| file | qtool s | weights SQNR dB | size MB | bits/w | types (count) | gguf-py | "
              "transformers | logits SQNR dB | max diff | top-1 % | perplexity |")  # fmt: skip
    print(header)
    print("|---" * 12 + "|")
    for label, path, args in runs:
        seconds, weights = quantize(a.float_gguf, path, args) if args else (0.0, float("inf"))
        count, bits, types = file_figures(path)
        if path.parent != a.workdir:  # transformers loads gguf_file from the directory given
            link = a.workdir / path.name
            if not link.exists():
                link.symlink_to(path.resolve())
        model = AutoModelForCausalLM.from_pretrained(
            a.workdir, gguf_file=path.name, dtype=torch.float32
        )
        v = versus(logits_of(model, ids), ref, ids)
        print(f"| {label} | {seconds:.1f} | {weights:.1f} | {path.stat().st_size / 1e6:.1f} | "
              f"{bits:.2f} | {types} | {count} tensors | OK | {v['sqnr']:.1f} | "
              f"{v['max_diff']:.3f} | {v['top1']:.1f} | {v['ppl']:.3f} |", flush=True)  # fmt: skip
        del model


if __name__ == "__main__":
    main()
