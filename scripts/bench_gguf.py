"""GGUF block kernels: qtool's fused (numba) and torch kernels vs gguf-py's numpy `gguf.quants`
(and, given a llama.cpp tree, ggml's C reference, single-threaded), in MB/s of float32 input.

Usage: python scripts/bench_gguf.py [--mib 64] [--repeat 5] [--ggml PATH/ggml] [--device cpu]
Rounds are interleaved (A B A B ...) and medians reported, so a neighbour's load hits both.
The torch kernels quantize K-types on a sixteenth of the input (they are slow); MB/s are of
the input each one gets. The fused kernels' numba compile (first run) is paid before timing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qtool.gguf_types import GGML_TYPES
from qtool.numerics import gguf as G
from qtool.numerics.select import Kernel

LEGACY = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]


def interleaved(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median seconds of each function over `repeat` interleaved rounds (after a warm-up)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def gguf_py(qtype: str, quantize: bool) -> Callable[[np.ndarray], np.ndarray]:
    from gguf import GGMLQuantizationType, quants

    t = GGMLQuantizationType[qtype]
    fn = quants.quantize if quantize else quants.dequantize
    return lambda a: fn(a, t)


def c_reference(ggml: Path, work: Path) -> Any:
    """scripts/gguf_golden.py's build of ggml-quants.c (x86-64 release flags) and its caller."""
    spec = importlib.util.spec_from_file_location(
        "gguf_golden", Path(__file__).with_name("gguf_golden.py")
    )
    assert spec is not None and spec.loader is not None
    golden = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(golden)
    lib = golden.build(ggml, work, golden.RELEASE_FLAGS, "bench")
    return lambda qtype, x: golden.quantize(lib, qtype, x)


def bench(args: argparse.Namespace, c_quantize: Any) -> list[dict[str, object]]:
    rows = []
    n = int(args.mib * 2**20 / 4) // 4096 * 4096
    x = torch.randn(n // 4096, 4096, generator=torch.Generator().manual_seed(0)) * 0.02
    xd, xn = x.to(args.device), x.numpy()
    small = xd[: max(1, xd.shape[0] // 16)]
    for qtype in LEGACY + K_TYPES:
        fns: dict[str, tuple[Callable[[], object], int]] = {}
        if args.device == "cpu":
            fns["qtool fused"] = (partial(G.quantize, xd, qtype, kernel=Kernel.FUSED), x.numel())
        xt = small if qtype in K_TYPES else xd
        fns["qtool torch"] = (partial(G.quantize, xt, qtype, kernel=Kernel.TORCH), xt.numel())
        if qtype in LEGACY:
            fns["gguf.quants"] = (partial(gguf_py(qtype, True), xn), x.numel())
        if c_quantize is not None:
            fns["C ref (1 thread)"] = (partial(c_quantize, qtype, xn), x.numel())
        raw = G.quantize(xd, qtype)
        deq: dict[str, tuple[Callable[[], object], int]] = {
            "qtool torch": (partial(G.dequantize, raw, qtype, kernel=Kernel.TORCH), x.numel()),
            "gguf.quants": (partial(gguf_py(qtype, False), raw.cpu().numpy()), x.numel()),
        }
        if args.device == "cpu":
            fused = partial(G.dequantize, raw, qtype, kernel=Kernel.FUSED)
            deq = {"qtool fused": (fused, x.numel()), **deq}
        for what, group in (("quantize", fns), ("dequantize", deq)):
            timed = interleaved({name: fn for name, (fn, _) in group.items()}, args.repeat)
            for name, seconds in timed.items():
                mb = group[name][1] * 4 / 1e6 / seconds
                rows.append({"type": qtype, "op": what, "impl": name, "MB/s": mb})
                print(f"{qtype:5} {what:10} {name:17} {mb:9.1f} MB/s of float32", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=64.0, help="float32 input size")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--ggml", type=Path, help="llama.cpp's ggml/ for the C reference")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__} on {torch.get_num_threads()} threads, "
          f"load average {load:.1f}, {args.mib:g} MiB of float32, {args.device}")  # fmt: skip
    bpw = ", ".join(f"{t} {GGML_TYPES[t].bits_per_weight:g}" for t in LEGACY + K_TYPES)
    print(f"bits per weight: {bpw}")
    with tempfile.TemporaryDirectory() as tmp:
        c_quantize = c_reference(args.ggml, Path(tmp)) if args.ggml else None
        bench(args, c_quantize)


if __name__ == "__main__":
    main()
