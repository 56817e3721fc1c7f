"""Golden outputs of ggml's reference K-quantizers, for tests/numerics/test_gguf.py.

Run by hand (not in CI): it compiles ggml-quants.c from a llama.cpp source tree you give it,
as llama.cpp's x86-64 release build compiles it (the ggml-base library: -O3 -DNDEBUG, no
-march flag, so no FMA and nothing to contract), in a temporary directory, loads it with ctypes
and writes the inputs and the raw block bytes of quantize_row_q{2..6}_K_ref to an .npz, and of
the legacy types for the hostile rows and blocks where only a zero's sign differs. The C
source is never copied into the repository.

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/src
    tar xzf /tmp/src/llama_cpp_python-0.3.36.tar.gz -C /tmp/src
    python scripts/gguf_golden.py /tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml

--nonfinite writes tests/data/gguf_golden_nonfinite.npz instead: rows with NaN, Inf and
float32's extremes at random places, quantized to every type (C's scans skip NaN where numpy's
and torch's reductions propagate it; qtool's fused kernels follow C).

--imatrix writes tests/data/gguf_golden_imatrix.npz instead: rows of 512 (two super-blocks, 16
legacy blocks) with one importance vector each (quant_weights, llama-quantize's sums / counts),
through ggml's quantize_q4_0/q4_1/q5_0/q5_1/q2_K/q3_K/q4_K/q5_K/q6_K (the *_impl paths that
take quant_weights; legacy ones use the whole row's mean square), called row by row.

--fma-study also builds it with -march=native (GCC contracts a*b+c into FMAs, its default for
GNU C) and with -march=native -ffp-contract=off, and prints how many rows each build changes.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

OUT = Path(__file__).parent.parent / "tests" / "data" / "gguf_golden.npz"
NONFINITE_OUT = OUT.with_name("gguf_golden_nonfinite.npz")
IMATRIX_OUT = OUT.with_name("gguf_golden_imatrix.npz")
# ggml's type ids, for the ggml_row_size stub that quantize_<type>() calls
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
            "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # fmt: skip
QK_K = 256
TYPES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per block
LEGACY = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}  # blocks of 32
RELEASE_FLAGS = ("-O3", "-DNDEBUG", "-std=gnu11")

# ggml-quants.c calls these from ggml.c; the reference quantizers never reach them.
STUBS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <stdint.h>
void ggml_abort(const char * file, int line, const char * fmt, ...) {
    fprintf(stderr, "ggml_abort %s:%d\n", file, line); abort();
}
size_t ggml_row_size(int type, int64_t ne) {
    switch (type) {  /* quantize_<type>() with quant_weights asks it; the _ref ones never do */
        case 2: return ne / 32 * 18;  case 3: return ne / 32 * 20;  case 6: return ne / 32 * 22;
        case 7: return ne / 32 * 24;  case 8: return ne / 32 * 34;  case 10: return ne / 256 * 84;
        case 11: return ne / 256 * 110; case 12: return ne / 256 * 144;
        case 13: return ne / 256 * 176; case 14: return ne / 256 * 210;
    }
    abort();
}
const char * ggml_type_name(int type) { (void)type; return "?"; }
size_t ggml_type_size(int type) { (void)type; abort(); }
"""


def build(ggml: Path, work: Path, flags: tuple[str, ...], name: str) -> ctypes.CDLL:
    """Compile ggml-quants.c (plus stubs) with `flags` into a shared library and load it."""
    stubs = work / "stubs.c"
    stubs.write_text(STUBS)
    lib = work / f"{name}.so"
    cmd = ["gcc", *flags, "-shared", "-fPIC", f"-I{ggml / 'include'}", f"-I{ggml / 'src'}",
           str(ggml / "src" / "ggml-quants.c"), str(stubs), "-o", str(lib), "-lm"]  # fmt: skip
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(lib))


def quantize(lib: ctypes.CDLL, qtype: str, x: np.ndarray) -> np.ndarray:
    """Raw blocks of quantize_row_<qtype>_ref over every row of float32 `x`."""
    size = {**TYPES, **LEGACY}[qtype]
    block = QK_K if qtype in TYPES else 32
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
    fn = getattr(lib, f"quantize_row_{qtype.lower().replace('_k', '_K')}_ref")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out


def quantize_weighted(lib: ctypes.CDLL, qtype: str, x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Raw blocks of ggml's quantize_<qtype>(row, ..., 1, n, qw[r]) for each row r of x."""
    size = {**TYPES, **LEGACY}[qtype]
    block = QK_K if qtype in TYPES else 32
    x = np.ascontiguousarray(x, dtype=np.float32)
    qw = np.ascontiguousarray(qw, dtype=np.float32)
    out = np.zeros((x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
    fn = getattr(lib, f"quantize_{qtype.lower().replace('_k', '_K')}")
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    fn.restype = ctypes.c_size_t
    for r in range(x.shape[0]):
        written = fn(x[r].ctypes.data, out[r].ctypes.data, 1, x.shape[1], qw[r].ctypes.data)
        assert written == out.shape[1], (qtype, written)
    return out


def imatrix_inputs(seed: int = 31) -> tuple[np.ndarray, np.ndarray]:
    """(rows, 512) float32 rows and (rows, 512) importance vectors: golden_inputs' rows two by
    two, each with a vector of mean squares as llama-imatrix gathers them (log-normal, bf16),
    some with ones, zeros in places or whole sub-blocks, tiny or huge values."""
    rng = np.random.default_rng(seed)
    x = golden_inputs()
    x = x[: len(x) // 2 * 2].reshape(-1, 2 * QK_K)
    n = 2 * QK_K
    kinds: list[Callable[[], np.ndarray]] = [
        lambda: bf16(np.exp(rng.standard_normal(n) * 2.0) * 1e-2),
        lambda: bf16(np.exp(rng.standard_normal(n) * 0.5)),
        lambda: np.ones(n),
        lambda: np.where(rng.random(n) < 0.2, 0.0, bf16(np.exp(rng.standard_normal(n)))),
        lambda: np.where(np.arange(n) // 16 % 5 == 1, 0.0, bf16(rng.random(n))),
        lambda: np.where(np.arange(n) < 256, 0.0, 1.0),
        lambda: bf16(np.exp(rng.standard_normal(n)) * 1e-30),
        lambda: bf16(np.exp(rng.standard_normal(n)) * 1e25),
    ]
    qw = np.stack([np.asarray(kinds[r % len(kinds)](), np.float32) for r in range(len(x))])
    return x, qw


def write_imatrix(lib: ctypes.CDLL, out: Path, source: bytes) -> None:
    x, qw = imatrix_inputs()
    qtypes = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
    outputs = {t.lower(): quantize_weighted(lib, t, x, qw) for t in qtypes}
    arrays: dict[str, Any] = {
        "x": x, "qw": qw, **outputs,
        "source_sha256": np.array(hashlib.sha256(source).hexdigest()),
        "cflags": np.array(" ".join(RELEASE_FLAGS)),
    }  # fmt: skip
    np.savez_compressed(out, **arrays)
    print(f"{out}: {len(x)} rows of {x.shape[1]}, {', '.join(outputs)}")


def hostile_rows(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """One row of `n` values per case that stresses a branch of the reference."""
    g = rng.standard_normal(n).astype(np.float32)
    sub = np.repeat(10.0 ** rng.integers(-6, 6, n // 16), 16).astype(np.float32)
    outlier = g.copy()
    outlier[rng.integers(n)] = 1000.0
    one_zero_sub = g.copy()
    one_zero_sub[32:64] = 0.0
    sparse = np.where(rng.random(n) < 0.05, g, 0.0)
    return [
        np.zeros(n), np.full(n, 1.0), np.full(n, -1.0), np.full(n, 1e-3), np.full(n, 7.5),
        g * 1e-40, np.where(g > 0, g * 1e-40, 0.0), np.full(n, 1.4e-45), g * 1e-20, g * 1e-15,
        g * 1e-14, g * 1e20, g * 1e30, g * 3e37, np.sign(g) * 3.4e38, np.full(n, 3.4e38),
        np.full(n, -3.4e38), np.arange(n) % 16 - 8.0, np.arange(n) % 32 - 16.0,
        (np.arange(n) % 16 - 8.0) + 0.5, np.arange(n) * 0.25 - 32.0, np.round(g * 8) / 8,
        np.round(g * 2) / 2, outlier, -np.abs(g), np.abs(g), -np.abs(g) - 5.0, np.abs(g) + 5.0,
        g * sub, one_zero_sub, sparse, np.where(np.arange(n) % 2 == 0, 1e6, 1e-6) * g,
        np.where(np.arange(n) == 0, 1.0, 0.0), np.where(np.arange(n) == n - 1, -1.0, 0.0),
        np.linspace(-1, 1, n), np.linspace(0, 1, n), np.linspace(-1, 0, n),
    ]  # fmt: skip


def bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even), kept as float32: what a bf16 checkpoint holds."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.int64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32)


def golden_inputs(seed: int = 23) -> np.ndarray:
    """(rows, 256) float32: the hostile rows, then Gaussian, uniform, heavy-tailed and
    half-precision rows (most weights are bf16/fp16 before they are float32; they also keep
    the file small, their low mantissa bits being zero)."""
    rng = np.random.default_rng(seed)
    rows = hostile_rows(rng, QK_K)
    rows += [rng.standard_normal(QK_K) * 0.02 for _ in range(40)]
    rows += [bf16(rng.standard_normal(QK_K) * 0.02) for _ in range(60)]
    rows += [bf16(rng.uniform(-1, 1, QK_K)) for _ in range(20)]
    rows += [bf16(rng.standard_t(2, QK_K)) for _ in range(20)]
    rows += [rng.standard_normal(QK_K).astype(np.float16) for _ in range(20)]
    rows += [bf16(rng.standard_normal(QK_K) * 10.0 ** rng.integers(-8, 8)) for _ in range(10)]
    return np.stack([np.asarray(r, dtype=np.float32) for r in rows])


def signed_zero_rows() -> np.ndarray:
    """(3, 256): blocks of 32 where only the sign of a zero tells C from numpy: +0.0 and -0.0
    both present at the minimum (Q4_1/Q5_1 store it), all-zero blocks starting with -0.0
    (Q4_0/Q5_0 store max / -8)."""
    blocks = []
    for a, b in [(0.0, -0.0), (-0.0, 0.0)]:
        for i, j in [(8, 25), (25, 8), (0, 31), (31, 0), (3, 4)]:
            for fill in (1.0, -1.0):
                block = np.full(32, fill, dtype=np.float32)
                block[i], block[j] = a, b
                blocks.append(block)
    for first in range(4):
        block = np.zeros(32, dtype=np.float32)
        block[: first + 1] = -0.0
        blocks.append(block)
    return np.stack(blocks).reshape(3, 256)


def nonfinite_rows(seed: int = 29, n: int = 32) -> np.ndarray:
    """(n, 256) Gaussian rows with 1-3 values replaced by NaN, +-Inf, +-0.0 or float32's
    extremes at random places (a NaN first, last or alone in a block included)."""
    rng = np.random.default_rng(seed)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.4e-45, 3.4e38, -3.4e38], np.float32)
    x = (rng.standard_normal((n, QK_K)) * 0.02).astype(np.float32)
    for row in x:
        k = rng.integers(1, 4)
        row[rng.integers(0, QK_K, k)] = rng.choice(specials, k)
    x[0, 0], x[1, 31], x[2, :32] = np.nan, np.nan, np.nan  # first, last, all of a block
    return x


def write_nonfinite(lib: ctypes.CDLL, out: Path) -> None:
    x = nonfinite_rows()
    outputs = {qtype.lower(): quantize(lib, qtype, x) for qtype in (*TYPES, *LEGACY)}
    arrays: dict[str, Any] = {"x": x, **outputs, "cflags": np.array(" ".join(RELEASE_FLAGS))}
    np.savez_compressed(out, **arrays)
    print(f"{out}: {len(x)} rows, {', '.join(outputs)}")


def check_gguf_py(lib: ctypes.CDLL, x: np.ndarray) -> None:
    """Print whether gguf.quants (when installed) gives the C reference's bytes (legacy types)."""
    try:
        from gguf import GGMLQuantizationType, quants
    except ImportError:
        print("gguf not installed: legacy types not cross-checked")
        return
    for qtype in LEGACY:
        ours = quants.quantize(x, GGMLQuantizationType[qtype])
        differ = int((ours != quantize(lib, qtype, x)).any(axis=1).sum())
        print(f"gguf.quants vs C reference: {qtype}: {differ} of {len(x)} rows differ")


def fma_study(ggml: Path, work: Path, x: np.ndarray) -> None:
    """How many rows change when the reference is built with -march=native (FMA contraction)."""
    ref = build(ggml, work, RELEASE_FLAGS, "ref")
    variants = {
        "-march=native (fp-contract=fast, GCC's GNU C default)": ("-march=native",),
        "-march=native -ffp-contract=off": ("-march=native", "-ffp-contract=off"),
    }
    for label, extra in variants.items():
        lib = build(ggml, work, (*RELEASE_FLAGS, *extra), label.split()[0][2:] + str(len(extra)))
        for qtype in (*TYPES, *LEGACY):
            a, b = quantize(ref, qtype, x), quantize(lib, qtype, x)
            print(f"{label}: {qtype}: {int((a != b).any(axis=1).sum())} of {len(x)} rows differ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ggml", type=Path, help="llama.cpp's ggml/ directory (src/, include/)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--fma-study", action="store_true")
    parser.add_argument("--nonfinite", action="store_true", help=f"write {NONFINITE_OUT.name}")
    parser.add_argument("--imatrix", action="store_true", help=f"write {IMATRIX_OUT.name}")
    args = parser.parse_args()
    x = golden_inputs()
    source = (args.ggml / "src" / "ggml-quants.c").read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        if args.nonfinite:
            write_nonfinite(build(args.ggml, Path(tmp), RELEASE_FLAGS, "ref"), NONFINITE_OUT)
            return
        if args.imatrix:
            write_imatrix(build(args.ggml, Path(tmp), RELEASE_FLAGS, "ref"), IMATRIX_OUT, source)
            return
        if args.fma_study:
            fma_study(args.ggml, Path(tmp), x)
            return
        lib = build(args.ggml, Path(tmp), RELEASE_FLAGS, "ref")
        check_gguf_py(lib, x)
        check_gguf_py(lib, signed_zero_rows())
        outputs = {qtype.lower(): quantize(lib, qtype, x) for qtype in TYPES}
        legacy_x = np.concatenate([x[: len(hostile_rows(np.random.default_rng(), QK_K))],
                                   signed_zero_rows()])  # fmt: skip
        outputs |= {f"legacy_{t.lower()}": quantize(lib, t, legacy_x) for t in LEGACY}
        outputs["legacy_x"] = legacy_x
    args.out.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, Any] = {
        "x": x,
        **outputs,
        "source_sha256": np.array(hashlib.sha256(source).hexdigest()),
        "cflags": np.array(" ".join(RELEASE_FLAGS)),
    }
    np.savez_compressed(args.out, **arrays)
    print(f"{args.out}: {len(x)} rows, {', '.join(outputs)}")


if __name__ == "__main__":
    main()
