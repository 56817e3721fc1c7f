"""SQNR of min-max vs the mse range search, and the search's throughput (issue 10 figures).

Usage: python scripts/numerics_sqnr.py [--size 4096]
Tensors: a size x size Gaussian with ~0.1 % outliers (x20), and every >= 2-D float tensor of
sample_weights/*.safetensors (pooled: 10 log10(sum x^2 / sum err^2) over all of them).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from qtool.numerics import kernels
from qtool.spec import Granularity, PerChannel, PerGroup, QSpec, RangeMethod, Scheme, StorageDtype

SAMPLES = Path(__file__).parent.parent / "sample_weights"
GRANULARITIES: list[Granularity] = [PerChannel(0), PerGroup(128), PerGroup(32)]


def gaussian_with_outliers(size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=gen)
    mask = torch.rand(size, size, generator=gen) < 0.001
    return torch.where(mask, x * 20, x)


def sample_tensors() -> list[torch.Tensor]:
    out = []
    for name in ("mlp.safetensors", "mlp-bf16.safetensors", "convnet.safetensors"):
        out += [
            t for t in load_file(SAMPLES / name).values() if t.is_floating_point() and t.ndim >= 2
        ]
    return out


def pooled_sqnr(
    tensors: list[torch.Tensor], g: Granularity, key: tuple[str, str], m: RangeMethod
) -> tuple[float, float]:
    """(pooled SQNR in dB, seconds spent quantizing, error figures included)."""
    spec = QSpec(Scheme(key[0]), StorageDtype(key[1]), g, m)
    signal = noise = seconds = 0.0
    for x in tensors:
        start = time.perf_counter()
        stats = kernels.quantize_tensor(x, spec).errors
        seconds += time.perf_counter() - start
        assert stats is not None
        signal += stats.sq_signal
        noise += stats.sq_error
    return 10 * math.log10(signal / noise), seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--scheme", default="sym")
    args = parser.parse_args()
    sets = {
        "gauss+outliers": [gaussian_with_outliers(args.size)],
        "sample_weights": sample_tensors(),
    }
    print(f"threads {torch.get_num_threads()}, scheme {args.scheme}")
    print("| tensors | dtype | granularity | minmax dB | mse dB | sq. error | mse s | mse MB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for set_name, tensors in sets.items():
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        for dtype in ("int8", "int4"):
            for g in GRANULARITIES:
                key = (args.scheme, dtype)
                base, _ = pooled_sqnr(tensors, g, key, RangeMethod.MINMAX)
                best, secs = pooled_sqnr(tensors, g, key, RangeMethod.MSE)
                change = 10 ** ((base - best) / 10) - 1
                print(
                    f"| {set_name} | {dtype} | {g.describe()} | {base:.2f} | {best:.2f} | "
                    f"{change:+.1%} | {secs:.2f} | {nbytes / secs / 1e6:.1f} |"
                )


if __name__ == "__main__":
    main()
