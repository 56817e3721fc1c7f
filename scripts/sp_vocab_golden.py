"""Golden tokenizer.* keys of llama.cpp's converter for SentencePiece models, for
tests/formats/gguf/test_sp_vocab.py (GOLDEN, TOKENIZER_SHA256).

Run by hand from the repository root (not in CI), with sentencepiece installed (the test extra
pins it) and a llama.cpp source tree (the one llama-cpp-python 0.3.36 vendors, as
docs/gguf.md's proof uses): it builds each tiny directory of tests/formats/gguf/sp_models.py
(CASES) in a temporary directory, converts it with that tree's convert_hf_to_gguf.py
(--outtype f32, its own gguf-py), converts it with qtool too, and prints the digest of the
converter's tokenizer.* keys, whether qtool's whole file is byte-identical to the converter's,
and the trained tokenizer.model's sha256.

    python scripts/sp_vocab_golden.py /tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from hashlib import sha256
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402

from qtool.formats.gguf.hf_export import export_float  # noqa: E402
from qtool.io.atomic import OutputSet  # noqa: E402
from tests.formats.gguf.sp_models import CASES, build, vocab_digest  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("llama_cpp", type=Path, help="a llama.cpp source tree")
    args = parser.parse_args()
    script = args.llama_cpp / "convert_hf_to_gguf.py"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for case in CASES:
            src = build(root, case)
            theirs, ours = root / f"{case}.conv.gguf", root / f"{case}.qtool.gguf"
            subprocess.run([sys.executable, str(script), str(src), "--outtype", "f32",
                            "--outfile", str(theirs)], check=True,
                           capture_output=True)  # fmt: skip
            with OutputSet() as outputs:
                export_float(src, ours, outputs, "F32")
                outputs.commit()
            same = theirs.read_bytes() == ours.read_bytes()
            model = sha256((src / "tokenizer.model").read_bytes()).hexdigest()
            digest = vocab_digest(gguf.GGUFReader(theirs))
            print(f'"{case}": "{digest}",  # whole file identical: {same}; model {model}')


if __name__ == "__main__":
    main()
