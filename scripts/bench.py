"""Benchmark qtool against the textbook kernel, torch's own quantizer and the memory/disk limits.

    python scripts/bench.py [--gib 1] [--repeat 5] [--json bench.json] [--skip-e2e]
                            [--sweep-gib 4] [--skip-kernels]

Kernel section (in memory, fp32 and bf16 weights of 4096x4096 and 4096x11008 up to --gib GiB):
throughput in GB/s of input, every method timed once per round, round after round (so load
from other processes hits them alike), median of --repeat rounds; "x limit" is the median of
the per-round ratios to the memory limit (a cast into a preallocated int8 buffer: read the
input once, write one byte per element). The fused CPU kernels (numerics/fused.py) are
measured when numba is installed.

End-to-end section: a deterministic --gib GiB fp32 safetensors checkpoint on disk; wall time of
`qtool quantize` (QTOOL_KERNEL auto, torch and fused) paired with the bare
`import torch, safetensors.torch` floor in every round (median of the per-round differences),
`cp` of the file, peak memory (the peak anonymous RSS sampled every 5 ms), a naive
load-all/save-all quantizer, and a checkpoint twice as large with the same largest tensor to
show that memory does not grow with checkpoint size. --sweep-gib: the same paired measurement
for checkpoints of 64 MiB up to that size, to show time linear in bytes.

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

from qtool.numerics import kernels, select
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
FUSED_SPECS = [
    (QSpec(), True),
    (QSpec(), False),
    (QSpec(Scheme.ASYM, StorageDtype.INT8, PerChannel(0)), True),
    (QSpec(granularity=PerGroup(128)), True),
    (QSpec(Scheme.SYM, StorageDtype.INT4, PerGroup(128)), True),
    (QSpec(granularity=PerTensor()), True),
    (QSpec(granularity=PerChannel(1)), True),
]


def fused_module() -> Any:
    """numerics.fused when numba is installed, else None (the fused rows are left out)."""
    if not select.numba_installed():
        return None
    from qtool.numerics import fused

    return fused


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
    return methods | fused_methods(xs)


def fused_methods(xs: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    fused = fused_module()
    if fused is None:
        return {}

    def run(spec: QSpec, errors: bool) -> Callable[[], object]:
        return lambda: [fused.quantize_tensor(x, spec, with_errors=errors) for x in xs]

    return {
        f"fused {spec.describe()}" + (" + error stats" if errors else ""): run(spec, errors)
        for spec, errors in FUSED_SPECS
    }


def interleaved(
    methods: dict[str, Callable[[], object]], repeat: int, limit: str
) -> dict[str, tuple[float, float]]:
    """(median seconds, median of per-round limit/method ratios) of every method, timed once
    per round in turn after one warm-up call each (first touch, cache loads)."""
    for fn in methods.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeat):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    base = times[limit]
    return {
        name: (
            statistics.median(ts),
            statistics.median(b / t for b, t in zip(base, ts, strict=True)),
        )
        for name, ts in times.items()
    }


def bench_range_search(repeat: int) -> list[dict[str, object]]:
    """--range mse on one 4096x4096 fp32 tensor (compute-bound: tens of candidate passes), next
    to min-max and the cast limit on the same tensor in the same rounds."""
    x = weights(0.0625, torch.float32)[0]
    nbytes = x.numel() * x.element_size()
    out = torch.empty(x.shape, dtype=torch.int8)
    fused = fused_module()
    methods: dict[str, Callable[[], object]] = {LIMIT: lambda: out.copy_(x)}
    for dtype in (StorageDtype.INT8, StorageDtype.INT4):
        for granularity in (PerChannel(0), PerGroup(128)):
            for method in RangeMethod:
                spec = QSpec(Scheme.SYM, dtype, granularity, method)
                label = f"{spec.describe()} + error stats"
                methods[f"qtool {label}"] = partial(kernels.quantize_tensor, x, spec)
                if fused is not None:
                    methods[f"fused {label}"] = partial(fused.quantize_tensor, x, spec)
    results = interleaved(methods, repeat, LIMIT)
    return [
        {
            "input": "float32 4096x4096",
            "method": name,
            "seconds": round(seconds, 4),
            "gb_per_s": round(nbytes / seconds / 1e9, 3),
            "fraction_of_limit": round(ratio, 4),
        }
        for name, (seconds, ratio) in results.items()
    ]


def bench_kernels(gib: float, repeat: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for dtype in (torch.float32, torch.bfloat16):
        xs = weights(gib, dtype)
        name = str(dtype).removeprefix("torch.")
        nbytes = sum(x.numel() * x.element_size() for x in xs)
        for method, (seconds, ratio) in interleaved(kernel_methods(xs), repeat, LIMIT).items():
            rows.append(
                {
                    "input": name,
                    "method": method,
                    "seconds": round(seconds, 4),
                    "gb_per_s": round(nbytes / seconds / 1e9, 2),
                    "fraction_of_limit": round(ratio, 3),
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


def run_measured(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """(seconds, peak RSS MiB, peak anonymous RSS MiB) of one child process, sampled every 5 ms
    from /proc (ru_maxrss would report this benchmark's own size: it survives fork and exec)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, **(env or {})}
    )
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
FLOOR = "import torch, safetensors.torch"

Command = tuple[list[str], Path, dict[str, str]]  # argv, the input to warm, extra environment


def paired(workdir: Path, commands: dict[str, Command], repeat: int) -> dict[str, Any]:
    """Every command `repeat` times, each run right after a run of the import floor (both with
    the input warmed and the previous outputs deleted); medians of the runs and of the per-pair
    differences, peaks over all runs."""
    floor = [sys.executable, "-c", FLOOR]
    runs: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, (cmd, source, env) in commands.items():
            warm(source)
            for leftover in workdir.glob("[qnc]*.safetensors"):
                if leftover.name.startswith(("q", "naive", "copy")):
                    leftover.unlink()
            base = run_measured(floor)[0]
            seconds, rss, anon = run_measured(cmd, env)
            runs[name].append((seconds, base, rss, anon))
    return {
        name: {
            "seconds": round(statistics.median(r[0] for r in rs), 3),
            "floor_seconds": round(statistics.median(r[1] for r in rs), 3),
            "seconds_above_import_floor": round(statistics.median(r[0] - r[1] for r in rs), 3),
            "peak_rss_mib": round(max(r[2] for r in rs)),
            "peak_anon_rss_mib": round(max(r[3] for r in rs)),
        }
        for name, rs in runs.items()
    }


def bench_end_to_end(workdir: Path, gib: float, repeat: int) -> dict[str, object]:
    """Remove the previous outputs before each run, as `cp` truncates its target: on VMs whose
    freed memory goes back to the host, fresh page-cache pages cost a host fault each, and both
    sides should pay (or not pay) that the same way."""
    src = workdir / "model.safetensors"
    big = workdir / "model-2x.safetensors"
    write_checkpoint(src, gib)
    write_checkpoint(big, 2 * gib)
    py = sys.executable
    quantize = [py, "-m", "qtool", "quantize", "--force", "-o"]
    q = [*quantize, str(workdir / "q.safetensors"), str(src)]
    commands: dict[str, Command] = {
        "cp": (["cp", str(src), str(workdir / "copy.safetensors")], src, {}),
        "qtool quantize": (q, src, {}),
        "qtool quantize, QTOOL_KERNEL=torch": (q, src, {select.ENV: "torch"}),
    }
    if select.numba_installed():
        commands["qtool quantize, QTOOL_KERNEL=fused"] = (q, src, {select.ENV: "fused"})
    commands["qtool quantize (2x checkpoint)"] = (
        [*quantize, str(workdir / "q2.safetensors"), str(big)],
        big,
        {},
    )
    naive = [py, "-c", NAIVE, str(src), str(workdir / "naive.safetensors")]
    commands["naive load-all/save_file"] = (naive, src, {})
    rows = paired(workdir, commands, repeat)
    size = src.stat().st_size
    for name, row in rows.items():
        nbytes = 2 * size if "2x" in name else size
        above = row["seconds"] if name == "cp" else row["seconds_above_import_floor"]
        row["s_per_gib_above_floor"] = round(above / (nbytes / GiB), 3)
    largest = 4096 * 11008 * 4 / (1 << 20)
    return {"checkpoint_bytes": size, "largest_tensor_mib": largest, "runs": rows}


def bench_growth(workdir: Path, max_gib: float, repeat: int) -> list[dict[str, object]]:
    """`qtool quantize` (auto) of fp32 checkpoints of 64 MiB, x4, .. up to max_gib, paired
    with the import floor: seconds above the floor per GiB should stay flat."""
    rows: list[dict[str, object]] = []
    sizes = [4**k / 16 for k in range(8) if 4**k / 16 <= max_gib]
    sizes += [max_gib] if max_gib not in sizes else []
    for gib in sizes:
        src = workdir / "sweep.safetensors"
        write_checkpoint(src, gib)
        size = src.stat().st_size
        cmd = [sys.executable, "-m", "qtool", "quantize", "--force", "-o"]
        cmd += [str(workdir / "q-sweep.safetensors"), str(src)]
        row = paired(workdir, {"qtool quantize": (cmd, src, {})}, repeat)["qtool quantize"]
        above = row["seconds_above_import_floor"]
        rows.append(
            {
                "checkpoint_gib": round(size / GiB, 3),
                **row,
                "s_per_gib_above_floor": round(above / (size / GiB), 3),
            }
        )
        print(f"sweep {size / GiB:.3f} GiB: {rows[-1]}", flush=True)
        src.unlink()
    return rows


FIRST_CALL = """
import json, sys, time
import torch
from qtool.spec import QSpec
x = torch.randn(64, 4096)
t0 = time.perf_counter()
import numba
t1 = time.perf_counter()
from qtool.numerics import fused
t2 = time.perf_counter()
fused.quantize_tensor(x, QSpec())
t3 = time.perf_counter()
fused.quantize_tensor(x.bfloat16(), QSpec())
t4 = time.perf_counter()
print(json.dumps({"import_numba": t1 - t0, "import_fused": t2 - t1,
                  "first_call_f32": t3 - t2, "first_call_bf16_after": t4 - t3}))
"""


def bench_first_call(repeat: int) -> dict[str, float]:
    """What a process pays before its first fused call, the on-disk cache warm (medians of
    fresh processes): import numba, import the kernels, the first call (cache load, numba's
    typing context, the thread pool), and one more input dtype."""
    if not select.numba_installed():
        return {}
    runs = []
    for _ in range(repeat + 1):  # the first run may compile (cold cache): dropped
        out = subprocess.run(
            [sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, check=True
        )
        runs.append(json.loads(out.stdout))
    return {k: round(statistics.median(r[k] for r in runs[1:]), 3) for k in runs[0]}


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
    header = f"{'command':<38} {'s':>7} {'floor':>6} {'s above floor':>14} {'s/GiB':>6}"
    print(header + f" {'peak RSS MiB':>13} {'peak anon MiB':>14}")
    for name, r in e2e["runs"].items():
        print(
            f"{name:<38} {r['seconds']:>7} {r['floor_seconds']:>6} "
            f"{r['seconds_above_import_floor']:>14} {r['s_per_gib_above_floor']:>6} "
            f"{r['peak_rss_mib']:>13} {r['peak_anon_rss_mib']:>14}"
        )


def print_tables(report: dict[str, Any]) -> None:
    print(f"machine: {json.dumps(report['machine'])}")
    if report["kernels"]:
        print_kernels(report)
    if report.get("range_search"):
        print("\nrange search, one 4096x4096 fp32 tensor")
    for row in report.get("range_search", []):
        print(f"{row['method']:<48} {row['gb_per_s']:>8.3f} GB/s {row['fraction_of_limit']:>8}")
    if report.get("first_call"):
        print(f"\nfirst fused call in a fresh process (s): {json.dumps(report['first_call'])}")
    if report.get("end_to_end"):
        print_end_to_end(report["end_to_end"])
    for row in report.get("growth", []):
        print(f"growth {row['checkpoint_gib']:>7} GiB: {row['seconds_above_import_floor']:>7} s "
              f"above the floor, {row['s_per_gib_above_floor']} s/GiB")  # fmt: skip
    if report.get("startup"):
        print_runs("start-up, median of interleaved runs", report["startup"])
    if report.get("tiny"):
        print_runs("many tiny tensors, median of interleaved runs", report["tiny"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the fp32 weights")
    parser.add_argument("--repeat", type=int, default=5, help="rounds of the kernel section")
    parser.add_argument("--e2e-repeat", type=int, default=7, help="paired end-to-end runs")
    parser.add_argument("--sweep-gib", type=float, default=0.0, help="growth sweep up to this")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--skip-e2e", action="store_true", help="kernels only")
    parser.add_argument("--skip-kernels", action="store_true", help="end to end only")
    parser.add_argument("--workdir", type=Path, help="where to write the checkpoints")
    parser.add_argument("--skip-startup", action="store_true", help="no start-up timings")
    parser.add_argument("--skip-tiny", action="store_true", help="no 50,000-tiny-tensor runs")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "machine": machine(),
        "load_before": os.getloadavg(),
        "kernel_gib": args.gib,
        "kernels": [] if args.skip_kernels else bench_kernels(args.gib, args.repeat),
        "range_search": [] if args.skip_kernels else bench_range_search(min(args.repeat, 3)),
        "first_call": {} if args.skip_kernels else bench_first_call(5),
    }
    workdir = Path(tempfile.mkdtemp(prefix="qtool-bench-", dir=args.workdir))
    try:
        if not args.skip_e2e:
            report["end_to_end"] = bench_end_to_end(workdir, args.gib, args.e2e_repeat)
        if args.sweep_gib:
            report["growth"] = bench_growth(workdir, args.sweep_gib, 3)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if not (args.skip_startup and args.skip_tiny):
        report |= bench_small(args)
    report["load_after"] = os.getloadavg()
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
