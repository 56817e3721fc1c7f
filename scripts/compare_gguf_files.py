"""Compare two GGUF files key by key and tensor by tensor (names, types, shapes, bytes), to check
`qtool quantize HF_DIR --format gguf` against llama.cpp's convert_hf_to_gguf.py (+ llama-quantize).

    python scripts/compare_gguf_files.py ours.gguf theirs.gguf [--ignore general.name ...]

Prints every difference and a summary line; exit 1 if a tensor's bytes or a key differs (keys
named by --ignore excepted). Reads both with gguf-py (the `gguf` package).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def _fields(path: str) -> tuple[dict[str, object], dict[str, tuple[str, tuple[int, ...], bytes]]]:
    import gguf

    r = gguf.GGUFReader(path)
    keys = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape),
                        np.asarray(t.data).tobytes()) for t in r.tensors}  # fmt: skip
    return keys, tensors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ours")
    parser.add_argument("theirs")
    parser.add_argument("--ignore", nargs="*", default=[])
    args = parser.parse_args()
    ka, ta = _fields(args.ours)
    kb, tb = _fields(args.theirs)
    bad = 0
    for key in sorted(set(ka) | set(kb)):
        if key not in ka or key not in kb:
            print(f"key {key}: only in {'ours' if key in ka else 'theirs'}")
            bad += key not in args.ignore
        elif ka[key] != kb[key]:
            print(f"key {key}: {str(ka[key])[:80]!r} != {str(kb[key])[:80]!r}")
            bad += key not in args.ignore
    if list(ka) != list(kb):
        print("key order differs")
    same = 0
    for name in sorted(set(ta) | set(tb)):
        if name not in ta or name not in tb:
            print(f"tensor {name}: only in {'ours' if name in ta else 'theirs'}")
            bad += 1
            continue
        (ty_a, sh_a, da), (ty_b, sh_b, db) = ta[name], tb[name]
        if (ty_a, sh_a) != (ty_b, sh_b):
            print(f"tensor {name}: {ty_a}{list(sh_a)} != {ty_b}{list(sh_b)}")
            bad += 1
        elif da != db:
            diff = sum(x != y for x, y in zip(da, db, strict=True))
            print(f"tensor {name}: {ty_a}, {diff:,} of {len(da):,} bytes differ")
            bad += 1
        else:
            same += 1
    if list(ta) != list(tb):
        print("tensor order differs")
    print(f"{len(ka)} / {len(kb)} keys, {same} of {len(tb)} tensors byte-identical, "
          f"{bad} differences")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
