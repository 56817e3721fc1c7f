"""Compare qtool's llama.cpp mixes (formats/gguf/mixes.py) with llama-quantize itself.

Run by hand (not in CI): for each float GGUF and each mix, `llama-quantize --dry-run` prints
the type it would give every tensor; this compares them with mixes.mix_types and, with
--record, writes the tensors (names, shapes) and llama-quantize's types to
tests/data/gguf_mixes_llama_quantize.json, which tests/formats/test_gguf_mixes.py checks
mix_types against without the binary. Exits 1 when a type differs.

    python scripts/gguf_mixes_check.py /tmp/llama-build/.../build/bin/llama-quantize \\
        tiny-f32.gguf smol-f16.gguf --record

llama-quantize is built from llama-cpp-python 0.3.36's vendored tree as
../shared/research/real-models.md says.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

from qtool.formats.gguf.mixes import MIXES, ModelFacts, mix_types
from qtool.io.gguf_file import GGUFFile

OUT = Path(__file__).parent.parent / "tests" / "data" / "gguf_mixes_llama_quantize.json"
_LINE = re.compile(r"\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\w+), (.*)$")


def llama_types(binary: Path, model: Path, mix: str) -> dict[str, str]:
    """The type llama-quantize --dry-run gives each tensor it would convert (upper case)."""
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run(
            [str(binary), "--dry-run", str(model), str(Path(tmp) / "out.gguf"), mix],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    out: dict[str, str] = {}
    for line in (run.stdout + run.stderr).splitlines():
        found = _LINE.search(line)
        if found is None:
            continue
        name, cur, rest = found.groups()
        target = re.search(r"\((\w+)\)\s*$", rest)
        out[name] = (target[1] if target else cur).upper()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary", type=Path, help="llama-quantize")
    parser.add_argument("models", type=Path, nargs="+", help="float GGUF files")
    parser.add_argument("--record", action="store_true", help=f"write {OUT.name}")
    args = parser.parse_args()
    record = []
    differing = 0
    for model in args.models:
        with GGUFFile(model) as f:
            tensors = list(f.header.tensors)
            facts = ModelFacts.of(f.header.metadata)
            meta = {k: v.value for k, v in f.header.metadata.items()
                    if k == "general.architecture" or k.startswith(f"{facts.arch}.")
                    and isinstance(v.value, (int, str))}  # fmt: skip
        entry = {"model": model.name, "metadata": meta,
                 "tensors": [[t.name, list(t.shape)] for t in tensors], "types": {}}  # fmt: skip
        for mix in MIXES:
            theirs = llama_types(args.binary, model, mix)
            ours = mix_types(MIXES[mix], tensors, facts)
            floats = {n: t for n, t in theirs.items() if n not in ours}
            differ = {n: (ours.get(n), theirs.get(n)) for n in ours if ours[n] != theirs.get(n)}
            differing += len(differ)
            print(f"{model.name} {mix}: {len(ours)} tensors, {len(differ)} differ {differ}"
                  f"{'' if not floats else f', kept by both: {len(floats)}'}")  # fmt: skip
            entry["types"][mix] = {n: theirs[n] for n in ours if n in theirs}
        record.append(entry)
    if args.record:
        OUT.write_text(json.dumps(record, indent=None, sort_keys=True) + "\n")
        print(f"wrote {OUT}")
    if differing:
        raise SystemExit(f"{differing} tensor types differ from llama-quantize's")


if __name__ == "__main__":
    main()
