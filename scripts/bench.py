"""Benchmark qtool against the textbook kernel, torch's own quantizer, llm-compressor and the
memory/disk limits.

    python scripts/bench.py [--gib 1] [--repeat 5] [--json bench.json] [--skip-e2e]
        [--skip-kernels] [--skip-costs] [--models] [--before TREE] [--sweep-gib 8]
        [--shard-gib 1] [--skip-startup] [--skip-tiny]

Kernel section (in memory, fp32 and bf16 weights of 4096x4096 and 4096x11008 up to --gib GiB):
throughput in GB/s of input, every method timed once per round, round after round (so load
from other processes hits them alike), median of --repeat rounds; "x limit" is the median of
the per-round ratios to the memory limit (a cast into a preallocated int8 buffer). Costs: ns
per element of each work class the automatic kernel choice knows (numerics/select.py COSTS).

End-to-end sections (scripts/bench_e2e.py): whole commands in fresh processes, each right after
a run of the bare `import torch, safetensors.torch` floor, one unmeasured warm-up round, medians
of the per-pair differences and same-run ratios, peak RSS and anonymous memory sampled every
5 ms. --gib: an fp32 checkpoint, int8 per channel, qtool with numba and with numba hidden, `cp`,
a naive load-all quantizer, a 2x checkpoint. --models: a SmolLM2-shaped bf16 model (built from
--smol-config) exported as compressed-tensors int4 g64 min-max and mse, llm-compressor's
model_free_ptq on it (its own venv under build/, made on first use), MiniLM with --range mse.
--before TREE: another qtool source tree (say `git archive main`) runs the same commands in the
same rounds. --sweep-gib: 64 MiB up to that size, one file and sharded (--shard-gib), skipping
sizes the disk cannot hold. Rendering: print_quantize of 272 rows to a pipe, both trees.

Start-up section: `qtool --help`, `quantize --help` and `inspect` of a 291-tensor checkpoint
against bare Python, median of at least 10 interleaved runs. Tiny-tensor section: `qtool
quantize` of 50,000 fp32 [16, 16] tensors and of a mix of 50,000 small tensors, with --json
and with the (piped) table; wall and CPU seconds. Results so far are written to --json after
each section.
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
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from bench_e2e import bench_end_to_end, bench_growth, bench_models, bench_render
from bench_e2e import ratio as same_run_ratio
from bench_models import llmc_python

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


# ---- what the kernel choice assumes -------------------------------------------------------------

COST_SPECS = {
    "minmax": QSpec(),
    "groups": QSpec(granularity=PerGroup(32)),
    "mse": QSpec(range_method=RangeMethod.MSE),
}


def _cast(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.int8).copy_(x)


def bench_costs(repeat: int) -> dict[str, Any]:
    """ns per element of each work class of numerics/select.py (COSTS), torch and fused kernels
    in turn on one 1024x4096 tensor, fp32 and bf16 (the best and the median of `repeat`
    rounds; the best is the quiet-machine figure COSTS wants)."""
    fused = fused_module()
    x32 = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0)) * 0.02
    ws = kernels.Workspace()
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = x32.to(dtype)
        for kind, spec in COST_SPECS.items():
            methods: dict[str, Callable[[], object]] = {
                "torch": partial(kernels.quantize_tensor, x, spec, workspace=ws),
                LIMIT: partial(_cast, x),
            }
            if fused is not None:
                methods["fused"] = partial(fused.quantize_tensor, x, spec)
            times: dict[str, list[float]] = {name: [] for name in methods}
            for _ in range(repeat):
                for name, fn in methods.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            for name, ts in times.items():
                ns = [t / x.numel() * 1e9 for t in ts]
                key = f"{str(dtype).removeprefix('torch.')} {kind} {name}"
                out[key] = {
                    "best_ns": round(min(ns), 2),
                    "median_ns": round(statistics.median(ns), 2),
                }
    out["load"] = round(os.getloadavg()[0], 1)
    return out


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


def print_paired(title: str, runs: dict[str, Any], nbytes: int | None = None) -> None:
    print(f"\n{title}")
    header = f"{'command':<44} {'s':>7} {'floor':>6} {'above floor':>12}"
    print(header + f" {'peak RSS MiB':>13} {'peak anon MiB':>14}")
    for name, r in runs.items():
        print(
            f"{name:<44} {r['seconds']:>7} {r['floor_seconds']:>6} "
            f"{r['seconds_above_import_floor']:>12} {r['peak_rss_mib']:>13} "
            f"{r['peak_anon_rss_mib']:>14}"
        )
    loads = [x for r in runs.values() for x in r["load_average"]]
    print(f"(load average {min(loads)}-{max(loads)} during these rounds)")


def print_ratios(report: dict[str, Any]) -> None:
    """Same-run ratios of the wall times, median of the per-round ratios."""
    e2e = report.get("end_to_end", {}).get("runs", {})
    models = report.get("models", {}).get("runs", {})
    pairs = [
        (e2e, "qtool quantize (before)", "qtool quantize"),
        (e2e, "qtool quantize, numba hidden (before)", "qtool quantize, numba hidden"),
        (models, "qtool ct int4 g64 minmax (before)", "qtool ct int4 g64 minmax"),
        (models, "qtool ct int4 g64 mse (before)", "qtool ct int4 g64 mse"),
        (models, "model_free_ptq int4 g64 minmax", "qtool ct int4 g64 minmax"),
        (models, "model_free_ptq int4 g64 minmax", "qtool ct int4 g64 mse"),
        (models, "qtool MiniLM int8 mse (before)", "qtool MiniLM int8 mse"),
    ]
    print("\nsame-run ratios of wall time (median of per-round ratios)")
    for rows, a, b in pairs:
        value = same_run_ratio(rows, a, b)
        if value is not None:
            print(f"{a} / {b}: {value}x")
    for a, b in [("model_free_ptq int4 g64 minmax", "qtool ct int4 g64 minmax")]:
        if a in models and b in models:
            mem = models[a]["peak_rss_mib"] / max(1, models[b]["peak_rss_mib"])
            print(f"peak RSS {a} / {b}: {mem:.2f}x")


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
    if report.get("costs"):
        print(f"\nns per element by work class: {json.dumps(report['costs'])}")
    if report.get("end_to_end"):
        size = report["end_to_end"]["checkpoint_bytes"] / GiB
        print_paired(f"end to end, {size:.2f} GiB fp32 safetensors", report["end_to_end"]["runs"])
    if report.get("models"):
        print_paired("SmolLM2-shaped bf16 model (compressed-tensors) and MiniLM",
                     report["models"]["runs"])  # fmt: skip
    if report.get("render"):
        print(f"\nprint_quantize of 272 rows to a pipe, s: {json.dumps(report['render'])}")
    print_ratios(report)
    for row in report.get("growth", []):
        kind = "sharded" if row["sharded"] else "one file"
        if "skipped" in row:
            print(f"growth {row['gib']:>7} GiB {kind}: skipped ({row['skipped']})")
            continue
        print(f"growth {row['gib']:>7} GiB {kind}: {row['seconds_above_import_floor']:>7} s "
              f"above the floor, {row['s_per_gib_above_floor']} s/GiB, peak anon "
              f"{row['peak_anon_rss_mib']} MiB")  # fmt: skip
    if report.get("startup"):
        print_runs("start-up, median of interleaved runs", report["startup"])
    if report.get("tiny"):
        print_runs("many tiny tensors, median of interleaved runs", report["tiny"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the fp32 weights")
    parser.add_argument("--repeat", type=int, default=5, help="rounds of the kernel section")
    parser.add_argument("--e2e-repeat", type=int, default=5, help="paired end-to-end runs")
    parser.add_argument("--sweep-gib", type=float, default=0.0, help="growth sweep up to this")
    parser.add_argument("--shard-gib", type=float, default=1.0, help="shards of the sweep")
    parser.add_argument("--before", type=Path, help="a qtool source tree to compare, same run")
    parser.add_argument("--models", action="store_true", help="SmolLM2-shaped, MiniLM, llmc")
    parser.add_argument("--no-llmc", action="store_true", help="skip model_free_ptq")
    parser.add_argument("--smol-config", type=Path, default=Path("/work/real/smollm2/config.json"))
    parser.add_argument("--minilm", type=Path, default=Path("/work/real/minilm/model.safetensors"))
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--skip-e2e", action="store_true", help="kernels only")
    parser.add_argument("--skip-kernels", action="store_true", help="no kernel section")
    parser.add_argument("--skip-costs", action="store_true", help="no work-class costs")
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
        "costs": {} if args.skip_costs else bench_costs(args.repeat),
    }
    workdir = Path(tempfile.mkdtemp(prefix="qtool-bench-", dir=args.workdir))
    try:
        _save(args.json, report)
        if args.models:
            llmc = None if args.no_llmc else llmc_python(Path(__file__).parent.parent / "build")
            report["models"] = bench_models(workdir, args.e2e_repeat, args.before, llmc,
                                            args.smol_config, args.minilm)  # fmt: skip
            report["render"] = bench_render(args.before, 3)
            _save(args.json, report)
        if not args.skip_e2e:
            report["end_to_end"] = bench_end_to_end(workdir, args.gib, args.e2e_repeat, args.before)
            _save(args.json, report)
        if args.sweep_gib:
            report["growth"] = bench_growth(workdir, args.sweep_gib, 1, args.shard_gib)
            _save(args.json, report)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if not (args.skip_startup and args.skip_tiny):
        report |= bench_small(args)
    report["load_after"] = os.getloadavg()
    print_tables(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def _save(path: Path | None, report: dict[str, Any]) -> None:
    """The results so far (a long run stopped early keeps its finished sections)."""
    if path is not None:
        path.write_text(json.dumps(report, indent=2) + "\n")


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
