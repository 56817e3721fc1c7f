"""A model directory's weights truncated while `qtool quantize HF_DIR --format gguf` reads them
(another process rewriting the checkpoint, a network file system losing pages): the run must
end in one line naming the file and tensor, exit 1, nothing at -o and nothing left in the
output or temporary directories. A reader that maps the file dies of SIGBUS instead (exit -7,
no message). By hand, never in CI (it writes a model of a few hundred MB):

    python scripts/hf_gguf_truncated.py /tmp/big --dtype F16 [--hidden 1024 --layers 8]

Makes a Llama of `--hidden` and `--layers` (random F32 weights, the tokenizer files of
`--tokenizer`, SmolLM2's by default) in DIR/model once,
starts the run with TMPDIR=DIR/tmp and -o DIR/out/x.gguf, truncates model.safetensors to half
its size once the output has `--after` bytes, waits for the run, prints its exit status, the
last line of its stderr and whatever is left in DIR/out and DIR/tmp, and restores the weights.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VOCAB = 49152  # SmolLM2's, whose tokenizer the model takes (llama.cpp knows its pre-tokenizer)


def model(directory: Path, hidden: int, layers: int, tokenizer: Path) -> Path:
    """The model directory (made once, kept for the next runs)."""
    src = directory / "model"
    if not (src / "model.safetensors").exists():
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden,
            num_hidden_layers=layers, num_attention_heads=hidden // 64,
            num_key_value_heads=hidden // 256, max_position_embeddings=128, bos_token_id=1,
            eos_token_id=0,
        )  # fmt: skip
        src.mkdir(parents=True, exist_ok=True)
        transformers.LlamaForCausalLM(config).save_pretrained(src)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / name, src / name)
        shutil.copy(src / "model.safetensors", directory / "weights.orig")
    return src


def written(out: Path) -> int:
    """Bytes under `out` so far (the output's temporary file while it is written)."""
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--dtype", default="F16")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokenizer", type=Path, default=Path("/tmp/smol/hf"))
    parser.add_argument("--after", type=int, default=8 << 20, help="output bytes before the cut")
    args = parser.parse_args()
    directory = args.directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    src = model(directory, args.hidden, args.layers, args.tokenizer)
    out, tmp = directory / "out", directory / "tmp"
    for d in (out, tmp):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    weights = src / "model.safetensors"
    qtool = [sys.executable, "-m", "qtool", "quantize", str(src), "--format", "gguf",
             "--dtype", args.dtype, "--threads", "1", "-o", str(out / "x.gguf")]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp)}
    run = subprocess.Popen(qtool, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    cut = False
    while run.poll() is None:
        if not cut and written(out) >= args.after:
            os.truncate(weights, weights.stat().st_size // 2)
            cut = True
            print(f"truncated {weights} to half after {written(out):,} bytes of output")
        time.sleep(0.01)
    err = run.stderr.read().decode() if run.stderr else ""
    shutil.copy(directory / "weights.orig", weights)
    print(f"exit status {run.returncode}" + (" (SIGBUS)" if run.returncode == -7 else ""))
    print("stderr:", err.strip().splitlines()[-1:] or "(nothing)")
    for d in (out, tmp):
        left = sorted(str(p.relative_to(d)) for p in d.rglob("*"))
        print(f"left in {d}: {left or 'nothing'}")


if __name__ == "__main__":
    main()
