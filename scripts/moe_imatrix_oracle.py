"""qtool calibrate against llama-imatrix on a tiny Mixtral, by hand (not in CI).

Builds the tiny Mixtral of tests/moe_models.py (2 blocks, 4 experts, top-2, byte-level
tokenizer), converts it to an F32 GGUF with the converter of a llama.cpp source tree
(convert_hf_to_gguf.py; two patches, for this tokenizer only: its pre-tokenizer is named
"gpt-2", which llama.cpp's hash table cannot know, and one merge of two bytes the text never
holds is added, since llama.cpp refuses a BPE vocabulary without merges; with no merge that
applies, every byte is one token either way), checks that llama-tokenize and the model's
tokenizer give the same ids, runs llama-imatrix (F32 KV cache, no flash attention) and qtool
calibrate on the same text and windows, and prints per entry the counts of both and the
largest relative difference of the sums.

    python scripts/moe_imatrix_oracle.py /tmp/llama-build/llama_cpp_python-0.3.36/vendor/llama.cpp
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONVERT = """
import runpy, sys
LLAMA = sys.argv[1]
sys.path.insert(0, LLAMA)
sys.path.insert(1, f"{LLAMA}/gguf-py")
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
import gguf
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
_init = gguf.SpecialVocab.__init__
def _with_a_merge(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if not self.merges:
        self.merges = ["\\u0100 \\u0100"]
gguf.SpecialVocab.__init__ = _with_a_merge
runpy.run_path(f"{LLAMA}/convert_hf_to_gguf.py", run_name="__main__")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("llama_cpp", type=Path, help="llama.cpp source tree, built in build/")
    parser.add_argument("--keep", type=Path, help="work here instead of a temporary directory")
    args = parser.parse_args()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        run(args.llama_cpp.resolve(), args.keep)
    else:
        with tempfile.TemporaryDirectory() as work:
            run(args.llama_cpp.resolve(), Path(work))


def run(llama: Path, work: Path) -> None:
    import transformers

    from qtool.engine.calibrate.run import CalibrateOptions, calibrate
    from qtool.formats.imatrix import read_imatrix
    from tests.moe_models import ORACLE_CHUNKS as CHUNKS
    from tests.moe_models import ORACLE_CTX as CTX
    from tests.moe_models import ORACLE_TEXT as TEXT
    from tests.moe_models import build_moe

    binaries = llama / "build" / "bin"
    model = build_moe(work / "mixtral", "mixtral")
    text = work / "t.txt"
    text.write_text(TEXT)
    gguf = work / "mixtral.f32.gguf"
    (work / "convert.py").write_text(CONVERT)
    subprocess.run([sys.executable, str(work / "convert.py"), str(llama), str(model),
                    "--outfile", str(gguf), "--outtype", "f32"], check=True,
                   capture_output=True)  # fmt: skip
    theirs = subprocess.run([str(binaries / "llama-tokenize"), "-m", str(gguf), "-f", str(text),
                             "--ids", "--log-disable"], check=True, capture_output=True,
                            text=True).stdout  # fmt: skip
    ids = [int(t) for t in theirs.strip().strip("[]").split(",")]
    mine = transformers.AutoTokenizer.from_pretrained(model)(TEXT)["input_ids"]
    print(f"token ids: {len(ids)} from llama-tokenize, {len(mine)} from the tokenizer, "
          f"{'the same' if ids == mine else 'DIFFERENT'}")  # fmt: skip
    llama_file = work / "llama.imatrix.gguf"
    subprocess.run([str(binaries / "llama-imatrix"), "-m", str(gguf), "-f", str(text),
                    "-c", str(CTX), "-b", str(CTX), "--chunks", str(CHUNKS), "-t", "1",
                    "-ctk", "f32", "-ctv", "f32", "-fa", "off", "-o", str(llama_file)],
                   check=True, capture_output=True)  # fmt: skip
    qtool_file = work / "qtool.imatrix.gguf"
    calibrate(model, qtool_file, CalibrateOptions((text,), tokens=CTX * CHUNKS, ctx=CTX))
    a, b = read_imatrix(llama_file), read_imatrix(qtool_file)
    print(
        f"entries: llama-imatrix {len(a.entries)}, qtool {len(b.entries)}, "
        f"{'the same names' if set(a.entries) == set(b.entries) else 'DIFFERENT names'}"
    )
    worst = 0.0
    for name in sorted(set(a.entries) & set(b.entries)):
        x, y = a.entries[name], b.entries[name]
        rel = float(np.max(np.abs(x.sums - y.sums) / np.maximum(np.abs(x.sums), 1e-30)))
        worst = max(worst, rel)
        same = "same counts" if x.counts.tolist() == y.counts.tolist() else "COUNTS DIFFER"
        print(f"  {name:28s} {list(x.sums.shape)!s:9s} counts {x.counts.tolist()} {same}; "
              f"sums within {rel:.1e}")  # fmt: skip
    print(f"largest relative difference of the sums: {worst:.2e}")
    same_bytes(binaries, gguf, llama_file, work)


def same_bytes(binaries: Path, gguf: Path, imatrix: Path, work: Path) -> None:
    """llama-quantize Q4_0 and qtool quantize --format gguf --dtype Q4_0 of the F32 GGUF with
    llama-imatrix's file: the stacked experts' bytes compared (qtool's --dtype Q4_0 is the
    type everywhere, llama-quantize's Q4_0 a mix: the head may differ)."""
    import gguf as gguf_py

    theirs, ours = work / "llama-q4_0.gguf", work / "qtool-q4_0.gguf"
    subprocess.run([str(binaries / "llama-quantize"), "--imatrix", str(imatrix), str(gguf),
                    str(theirs), "Q4_0", "1"], check=True, capture_output=True)  # fmt: skip
    subprocess.run([sys.executable, "-m", "qtool", "quantize", str(gguf), "--format", "gguf",
                    "--dtype", "Q4_0", "--imatrix", str(imatrix), "-o", str(ours)],
                   check=True, capture_output=True)  # fmt: skip
    a, b = ({t.name: t for t in gguf_py.GGUFReader(p).tensors} for p in (theirs, ours))
    for name in [n for n in a if "_exps." in n]:
        same = a[name].tensor_type == b[name].tensor_type and bytes(a[name].data) == bytes(
            b[name].data
        )
        print(f"  {name:28s} Q4_0 with the imatrix: {'byte-identical' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
