"""Perplexity of a Hugging Face model with transformers, computed as llama.cpp's llama-perplexity
computes it, to check `qtool quantize HF_DIR --format gguf` against the model it came from:

    python scripts/hf_gguf_perplexity.py /tmp/smol/hf /usr/share/common-licenses/GPL-3 --ctx 512
    llama-perplexity -m out.gguf -f /usr/share/common-licenses/GPL-3 -c 512

llama-perplexity's method (tools/perplexity/perplexity.cpp, perplexity()): the whole text
tokenized once (BOS only when the tokenizer adds one), cut into chunks of ctx tokens, each
evaluated alone; the tokens of each chunk's second half are scored (j from ctx/2 to ctx-2
predicting j+1). Prints the chunk count, token count and the final estimate with its error.
--ids scores llama.cpp's own token ids (`llama-tokenize -m X.gguf -f TEXT --ids --log-disable`),
which tells a tokenizer's difference from the arithmetic's.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("text", type=Path)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--ids",
        type=Path,
        help="token ids to score instead of the text's "
        "(llama-tokenize --ids output: llama.cpp's own tokenization)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    ids = tok(args.text.read_text(encoding="utf-8"), add_special_tokens=True).input_ids
    if args.ids is not None:
        ids = [int(i) for i in args.ids.read_text().strip().strip("[]").split(",")]
    chunks = len(ids) // args.ctx
    first = args.ctx // 2
    nll, count, sq = 0.0, 0, 0.0
    for c in range(chunks):
        chunk = torch.tensor([ids[c * args.ctx : (c + 1) * args.ctx]])
        with torch.no_grad():
            logp = torch.log_softmax(model(chunk).logits[0].double(), dim=-1)
        for j in range(first, args.ctx - 1):
            v = -float(logp[j, chunk[0, j + 1]])
            nll, sq, count = nll + v, sq + v * v, count + 1
        print(f"[{c + 1}]{math.exp(nll / count):.4f}", flush=True)
    mean = nll / count
    err = math.sqrt(max(sq / count - mean * mean, 0.0) / max(count - 1, 1))
    print(f"tokens {len(ids)}, chunks {chunks}, ctx {args.ctx}: "
          f"PPL = {math.exp(mean):.4f} +/- {math.exp(mean) * err:.5f}")  # fmt: skip


if __name__ == "__main__":
    main()
