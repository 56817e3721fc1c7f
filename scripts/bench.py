"""Benchmark qtool against the textbook kernel, torch's own quantizer and the memory/disk limits.

    python scripts/bench.py [--gib 1] [--repeat 5] [--json bench.json] [--skip-e2e]

Kernel section (in memory, fp32 and bf16 weights of 4096x4096 and 4096x11008 up to --gib GiB):
throughput in GB/s of input, median of --repeat runs, every method measured in the same run,
against the memory limit (a cast into a preallocated int8 buffer: read the input once, write
one byte per element).

End-to-end section: a deterministic --gib GiB fp32 safetensors checkpoint on disk; wall time of
`qtool quantize` against the bare `import torch, safetensors` floor and `cp` of the file, peak
memory (ru_maxrss, and the peak anonymous RSS sampled every 5 ms), a naive load-all/save-all
quantizer for comparison, and a checkpoint twice as large with the same largest tensor to show
that memory does not grow with checkpoint size.

Start-up section: `qtool --help`, `quantize --help` and `inspect` of a 291-tensor checkpoint
against bare Python, median of at least 10 interleaved runs. Tiny-tensor section: `qtool
quantize` of 50,000 fp32 [16, 16] tensors and of a mix of 50,000 small tensors, with --json
and with the (piped) table; wall and CPU seconds (skip with --skip-startup / --skip-tiny).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from qtool.numerics import kernels
from qtool.spec import PerChannel, PerGroup, PerTensor, QSpec, RangeMethod, Scheme, StorageDtype

SHAPES = [(4096, 4096), (4096, 11008)]
GiB = 1 << 30


def machine() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem, 1),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def weights(gib: float, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out: list[torch.Tensor] = []
    total, i = 0, 0
    while total < gib * GiB or not out:
        shape = SHAPES[i % len(SHAPES)]
        out.append((torch.randn(shape, generator=gen) * 0.02).to(dtype))
        total += out[-1].numel() * 4
        i += 1
    return out


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: first touch of buffers, lazy initialisation
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def textbook(x: torch.Tensor) -> torch.Tensor:
    """What most code does: whole-tensor temporaries, one op at a time."""
    scale = x.float().abs().amax(dim=1, keepdim=True) / 127
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)


def torch_per_channel(x: torch.Tensor) -> torch.Tensor:
    scale = (x.float().abs().amax(dim=1) / 127).double()
    zero = torch.zeros(x.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_channel(x.float(), scale, zero, 0, torch.qint8).int_repr()


LIMIT = "memory limit (cast into int8 buffer)"


def kernel_methods(xs: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    """Every contender, each a closure over the same weights."""
    outs = [torch.empty(x.shape, dtype=torch.int8) for x in xs]
    ws = kernels.Workspace()

    def limit() -> None:
        for x, o in zip(xs, outs, strict=True):
            o.copy_(x)

    def qtool_run(spec: QSpec, errors: bool) -> Callable[[], object]:
        return lambda: [
            kernels.quantize_tensor(x, spec, with_errors=errors, workspace=ws) for x in xs
        ]

    methods: dict[str, Callable[[], object]] = {
        LIMIT: limit,
        "textbook per-channel": lambda: [textbook(x) for x in xs],
        "torch.quantize_per_channel": lambda: [torch_per_channel(x) for x in xs],
    }
    for scheme in Scheme:
        for granularity in (PerChannel(0), PerGroup(128), PerTensor()):
            spec = QSpec(scheme, StorageDtype.INT8, granularity)
            for errors in (False, True):
                label = f"qtool {spec.describe()}" + (" + error stats" if errors else "")
                methods[label] = qtool_run(spec, errors)
    for dtype in (StorageDtype.INT4, StorageDtype.UINT4):
        spec = QSpec(Scheme.SYM, dtype, PerGroup(128))
        methods[f"qtool {spec.describe()} + error stats (packed)"] = qtool_run(spec, True)
    return methods


def bench_range_search(repeat: int) -> list[dict[str, object]]:
    """--range mse on one 4096x4096 fp32 tensor (compute-bound: tens of candidate passes), next
    to min-max on the same tensor in the same run."""
    x = weights(0.0625, torch.float32)[0]
    nbytes = x.numel() * x.element_size()
    rows: list[dict[str, object]] = []
    for dtype in (StorageDtype.INT8, StorageDtype.INT4):
        for granularity in (PerChannel(0), PerGroup(128)):
            for method in RangeMethod:
                spec = QSpec(Scheme.SYM, dtype, granularity, method)
                seconds = median_seconds(partial(kernels.quantize_tensor, x, spec), repeat)
                rows.append(
                    {
                        "input": "float32 4096x4096",
                        "method": f"qtool {spec.describe()} + error stats",
                        "seconds": round(seconds, 4),
                        "gb_per_s": round(nbytes / seconds / 1e9, 3),
                    }
                )
    return rows


def bench_kernels(gib: float, repeat: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for dtype in (torch.float32, torch.bfloat16):
        xs = weights(gib, dtype)
        name = str(dtype).removeprefix("torch.")
        nbytes = sum(x.numel() * x.element_size() for x in xs)
        results = {m: median_seconds(fn, repeat) for m, fn in kernel_methods(xs).items()}
        limit_gbs = nbytes / results[LIMIT] / 1e9
        for method, seconds in results.items():
            gbs = nbytes / seconds / 1e9
            rows.append(
                {
                    "input": name,
                    "method": method,
                    "seconds": round(seconds, 4),
                    "gb_per_s": round(gbs, 2),
                    "fraction_of_limit": round(gbs / limit_gbs, 3),
                }
            )
        ref = [textbook(x) for x in xs]
        ours = [kernels.quantize_tensor(x, QSpec(), with_errors=False).q for x in xs]
        identical = all(torch.equal(a, b) for a, b in zip(ref, ours, strict=True))
        rows.append({"input": name, "codes_match_textbook": identical})
    return rows


# ---- end to end --------------------------------------------------------------------------------


def write_checkpoint(path: Path, gib: float) -> None:
    from safetensors.torch import save_file

    tensors = {f"layers.{i}.weight": x for i, x in enumerate(weights(gib, torch.float32))}
    for i in range(len(tensors)):
        tensors[f"layers.{i}.bias"] = torch.zeros(4096)
    save_file(tensors, path, metadata={"format": "pt"})


def warm(path: Path) -> None:
    """Read a file once so that it is in the page cache (this VM evicts it eagerly)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 23):
            pass


def run_measured(cmd: list[str]) -> tuple[float, float, float]:
    """(seconds, peak RSS MiB, peak anonymous RSS MiB) of one child process, sampled every 5 ms
    from /proc (ru_maxrss would report this benchmark's own size: it survives fork and exec)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peaks = {"VmHWM:": 0, "RssAnon:": 0}

    def sample() -> None:
        status = Path(f"/proc/{proc.pid}/status")
        while proc.poll() is None:
            try:
                for line in status.read_text().splitlines():
                    key = line.split(maxsplit=1)[0] if line else ""
                    if key in peaks:
                        peaks[key] = max(peaks[key], int(line.split()[1]))
            except (OSError, ValueError, IndexError):
                pass
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, stderr = proc.communicate()
    seconds = time.perf_counter() - start
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {stderr.decode()}")
    return seconds, peaks["VmHWM:"] / 1024, peaks["RssAnon:"] / 1024


NAIVE = """
import sys, torch
from safetensors.torch import load_file, save_file
sd = load_file(sys.argv[1])
out = {}
for name, x in sd.items():
    if x.ndim >= 2:
        s = x.abs().amax(dim=1, keepdim=True) / 127
        out[name] = torch.round(x / s).clamp(-127, 127).to(torch.int8)
        out[name + ".scale"] = s.squeeze(1)
    else:
        out[name] = x
save_file(out, sys.argv[2])
"""


def bench_end_to_end(workdir: Path, gib: float, repeat: int) -> dict[str, object]:
    src = workdir / "model.safetensors"
    big = workdir / "model-2x.safetensors"
    write_checkpoint(src, gib)
    write_checkpoint(big, 2 * gib)
    py = sys.executable
    size = src.stat().st_size

    def median(cmd: list[str], source: Path = src) -> tuple[float, float, float]:
        runs = []
        for _ in range(repeat):
            warm(source)  # every contender starts with its input in the page cache
            # Remove the previous outputs first, as `cp` truncates its target: on VMs whose
            # freed memory goes back to the host, fresh page-cache pages cost a host fault
            # each, and both sides should pay (or not pay) that the same way.
            for leftover in workdir.glob("[qnc]*.safetensors"):
                if leftover.name.startswith(("q", "naive", "copy")):
                    leftover.unlink()
            runs.append(run_measured(cmd))
        return (
            statistics.median(r[0] for r in runs),
            max(r[1] for r in runs),
            max(r[2] for r in runs),
        )

    quantize = [py, "-m", "qtool", "quantize", "--force", "-o"]
    results = {
        "import floor": median([py, "-c", "import torch, safetensors"]),
        "cp": median(["cp", str(src), str(workdir / "copy.safetensors")]),
        "qtool quantize": median([*quantize, str(workdir / "q.safetensors"), str(src)]),
        "qtool quantize (2x checkpoint)": median(
            [*quantize, str(workdir / "q2.safetensors"), str(big)], big
        ),
        "naive load-all/save_file": median(
            [py, "-c", NAIVE, str(src), str(workdir / "naive.safetensors")]
        ),
    }
    floor = results["import floor"][0]
    rows = {}
    for name, (seconds, rss, anon) in results.items():
        nbytes = 2 * size if "2x" in name else size
        above = seconds - floor if name not in ("cp",) else seconds
        rows[name] = {
            "seconds": round(seconds, 3),
            "seconds_above_import_floor": round(seconds - floor, 3),
            "gb_per_s_above_floor": round(nbytes / above / 1e9, 2) if above > 0 else None,
            "peak_rss_mib": round(rss),
            "peak_anon_rss_mib": round(anon),
        }
    largest = 4096 * 11008 * 4 / (1 << 20)
    return {"checkpoint_bytes": size, "largest_tensor_mib": largest, "runs": rows}


# ---- start-up and many tiny tensors ------------------------------------------------------------


def cpu_and_wall(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) of one run; stdout and stderr discarded."""
    before = os.times()
    start = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - start
    after = os.times()
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.decode()}")
    return wall, (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )


def median_runs(commands: dict[str, list[str]], repeat: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds of each command, the commands interleaved run by run (so a
    change of load on a shared machine hits them all alike)."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, cmd in commands.items():
            runs[name].append(cpu_and_wall(cmd))
    return {
        name: {
            "seconds": round(statistics.median(r[0] for r in rs), 3),
            "cpu_seconds": round(statistics.median(r[1] for r in rs), 3),
        }
        for name, rs in runs.items()
    }


def bench_startup(workdir: Path, repeat: int) -> dict[str, object]:
    """`qtool --help` and `qtool inspect` of a checkpoint with as many tensors as Llama-2-7B
    (291), against bare Python; median of `repeat` (at least 10) interleaved runs."""
    from safetensors.torch import save_file

    model = workdir / "model.safetensors"
    save_file({f"model.layers.{i}.weight": torch.zeros(64, 64) for i in range(291)}, model)
    py = sys.executable
    commands = {
        "python -c pass": [py, "-c", "pass"],
        "qtool --help": [py, "-m", "qtool", "--help"],
        "qtool quantize --help": [py, "-m", "qtool", "quantize", "--help"],
        "qtool inspect model.safetensors": [py, "-m", "qtool", "inspect", str(model)],
        "qtool inspect --json": [py, "-m", "qtool", "inspect", str(model), "--json"],
    }
    return {"runs": median_runs(commands, max(repeat, 10)), "load": os.getloadavg()[0]}


def write_tiny(workdir: Path) -> dict[str, Path]:
    """50,000 fp32 [16, 16] weights; and a mix of 25,000 small weights (fp32, bf16, fp16;
    shapes [16, 16], [8, 32], [4, 3, 3], [64, 4], [2, 2]) with 25,000 biases and an int tensor."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    uniform = workdir / "tiny-16x16.safetensors"
    w = torch.randn(50_000, 16, 16, generator=gen)
    save_file({f"layers.{i}.weight": w[i].clone() for i in range(50_000)}, uniform)
    mixed = workdir / "tiny-mix.safetensors"
    shapes = [((16, 16), torch.float32), ((8, 32), torch.bfloat16), ((4, 3, 3), torch.float16),
              ((64, 4), torch.float32), ((2, 2), torch.float32)]  # fmt: skip
    tensors: dict[str, torch.Tensor] = {"steps": torch.arange(10)}
    for i in range(25_000):
        shape, dtype = shapes[i % len(shapes)]
        tensors[f"m.{i}.weight"] = torch.randn(shape, generator=gen).to(dtype)
        tensors[f"m.{i}.bias"] = torch.randn(16, generator=gen)
    save_file(tensors, mixed)
    return {"50,000 x [16, 16] fp32": uniform, "25,000 weights + 25,000 biases": mixed}


def bench_tiny(workdir: Path, repeat: int) -> dict[str, object]:
    """`qtool quantize` of 50,000 tiny tensors (goal: under 10 s), with --json and with the
    table (piped: it shows the 50 worst rows), median of `repeat` interleaved runs."""
    py = sys.executable
    commands = {}
    for label, src in write_tiny(workdir).items():
        out = ["-o", str(workdir / f"q-{src.name}"), "--force"]
        quantize = [py, "-m", "qtool", "quantize", str(src), *out]
        commands[f"{label}, --json"] = [*quantize, "--json"]
        commands[f"{label}, table"] = quantize
    return {"runs": median_runs(commands, repeat), "load": os.getloadavg()[0]}


def print_runs(title: str, section: dict[str, Any]) -> None:
    print(f"\n{title} (load average {section['load']:.1f})")
    print(f"{'command':<48} {'s':>8} {'CPU s':>8}")
    for name, r in section["runs"].items():
        print(f"{name:<48} {r['seconds']:>8} {r['cpu_seconds']:>8}")


def print_kernels(report: dict[str, Any]) -> None:
    print(f"\nkernels, in memory ({report['kernel_gib']} GiB of fp32 weights, bf16 half that)")
    print(f"{'input':<9} {'method':<48} {'GB/s':>7} {'x limit':>8}")
    for row in report["kernels"]:
        if "method" in row:
            print(
                f"{row['input']:<9} {row['method']:<48} {row['gb_per_s']:>7} "
                f"{row['fraction_of_limit']:>8}"
            )
        else:
            print(f"{row['input']:<9} codes identical to the textbook kernel: "
                  f"{row['codes_match_textbook']}")  # fmt: skip


def print_end_to_end(e2e: dict[str, Any]) -> None:
    print(f"\nend to end, {e2e['checkpoint_bytes'] / GiB:.2f} GiB fp32 safetensors "
          f"(largest tensor {e2e['largest_tensor_mib']:.0f} MiB)")  # fmt: skip
    header = f"{'command':<34} {'s':>7} {'s above floor':>14} {'peak RSS MiB':>13}"
    print(header + f" {'peak anon MiB':>14}")
    for name, r in e2e["runs"].items():
        print(
            f"{name:<34} {r['seconds']:>7} {r['seconds_above_import_floor']:>14} "
            f"{r['peak_rss_mib']:>13} {r['peak_anon_rss_mib']:>14}"
        )


def print_tables(report: dict[str, Any]) -> None:
    print(f"machine: {json.dumps(report['machine'])}")
    if report["kernels"]:
        print_kernels(report)
    for row in report.get("range_search", []):
        print(f"{row['method']:<44} {row['gb_per_s']:>8.3f} GB/s  ({row['seconds']} s)")
    if report.get("end_to_end"):
        print_end_to_end(report["end_to_end"])
    if report.get("startup"):
        print_runs("start-up, median of interleaved runs", report["startup"])
    if report.get("tiny"):
        print_runs("many tiny tensors, median of interleaved runs", report["tiny"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the fp32 weights")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--skip-e2e", action="store_true", help="kernels only")
    parser.add_argument("--skip-kernels", action="store_true", help="end to end only")
    parser.add_argument("--workdir", type=Path, help="where to write the checkpoints")
    parser.add_argument("--skip-startup", action="store_true", help="no start-up timings")
    parser.add_argument("--skip-tiny", action="store_true", help="no 50,000-tiny-tensor runs")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "machine": machine(),
        "kernel_gib": args.gib,
        "kernels": [] if args.skip_kernels else bench_kernels(args.gib, args.repeat),
        "range_search": [] if args.skip_kernels else bench_range_search(min(args.repeat, 3)),
    }
    if not args.skip_e2e:
        workdir = Path(tempfile.mkdtemp(prefix="qtool-bench-", dir=args.workdir))
        try:
            report["end_to_end"] = bench_end_to_end(workdir, args.gib, min(args.repeat, 3))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    if not (args.skip_startup and args.skip_tiny):
        report |= bench_small(args)
    print_tables(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def bench_small(args: argparse.Namespace) -> dict[str, Any]:
    """The start-up and tiny-tensor sections, in a scratch directory of their own."""
    workdir = Path(tempfile.mkdtemp(prefix="qtool-bench-", dir=args.workdir))
    try:
        report: dict[str, Any] = {}
        if not args.skip_startup:
            report["startup"] = bench_startup(workdir, args.repeat)
        if not args.skip_tiny:
            report["tiny"] = bench_tiny(workdir, min(args.repeat, 3))
        return report
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
