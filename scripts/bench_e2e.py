"""End-to-end sections of scripts/bench.py (imported by it): whole commands in fresh processes,
each run right after a run of the bare `import torch, safetensors.torch` floor, medians of the
per-pair differences, peak memory sampled from /proc; a source tree given with --before runs
the same commands in the same rounds, so before/after ratios come from one run.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_models import (
    GiB,
    free_bytes,
    llmc_command,
    qtool_command,
    sweep_sizes,
    tree_env,
    write_smol,
)

SHAPES = [(4096, 4096), (4096, 11008)]
FLOOR = "import torch, safetensors.torch"
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


@dataclass(frozen=True)
class Command:
    """One contender: its argv, the input warmed before each run, its environment, and the
    outputs removed before each run (as `cp` truncates its target, every contender starts
    from no output: on this VM fresh page-cache pages cost a host fault each)."""

    argv: list[str]
    source: Path
    env: dict[str, str] = field(default_factory=dict)
    outputs: tuple[Path, ...] = ()


# ---- inputs ------------------------------------------------------------------------------------


def checkpoint_tensors(gib: float) -> Iterator[tuple[str, tuple[int, ...], int]]:
    """(name, shape, seed) of a deterministic fp32 checkpoint of about `gib` GiB: weights of
    4096x4096 and 4096x11008 in turn, a 4096 bias each."""
    total, i = 0, 0
    while total < gib * GiB or i == 0:
        shape = SHAPES[i % len(SHAPES)]
        yield f"layers.{i}.weight", shape, i
        yield f"layers.{i}.bias", (4096,), -1
        total += shape[0] * shape[1] * 4
        i += 1


def _tensor(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    if seed < 0:
        return torch.zeros(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def _write_file(path: Path, items: list[tuple[str, tuple[int, ...], int]]) -> int:
    """A safetensors file written tensor by tensor (never the whole checkpoint in memory)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in items:
        nbytes = 4 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, shape, seed in items:
            f.write(_tensor(shape, seed).numpy().tobytes())
    return offset


def write_checkpoint(path: Path, gib: float, shard_gib: float | None = None) -> int:
    """The checkpoint as one file, or (shard_gib) a directory of shards with an index;
    returns its bytes of tensors."""
    items = list(checkpoint_tensors(gib))
    if shard_gib is None:
        return _write_file(path, items)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, tuple[int, ...], int]]] = [[]]
    size = 0
    for item in items:
        nbytes = 4 * item[1][0] * (item[1][1] if len(item[1]) > 1 else 1)
        if shards[-1] and size + nbytes > shard_gib * GiB:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        total += _write_file(path / name, shard)
        weight_map |= {n: name for n, _, _ in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def warm(path: Path) -> None:
    """Read a file (or a directory's files) once, into the page cache (this VM evicts it)."""
    for p in sorted(path.iterdir()) if path.is_dir() else [path]:
        with open(p, "rb", buffering=0) as f:
            while f.read(1 << 23):
                pass


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


# ---- measuring ---------------------------------------------------------------------------------


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
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {stderr.decode()[-2000:]}")
    return seconds, peaks["VmHWM:"] / 1024, peaks["RssAnon:"] / 1024


def paired(commands: dict[str, Command], repeat: int, warmup: bool = True) -> dict[str, Any]:
    """Every command once unmeasured (caches: numba's machine code, the page cache), then
    `repeat` rounds in which each runs right after a run of the import floor; medians of the
    runs and of the per-pair differences, peaks over all runs, the per-round differences."""
    floor = [sys.executable, "-c", FLOOR]
    runs: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in commands}
    loads = [os.getloadavg()[0]]
    for k in range(repeat + (1 if warmup else 0)):
        for name, c in commands.items():
            warm(c.source)
            for out in c.outputs:
                _remove(out)
            base = run_measured(floor)[0]
            seconds, rss, anon = run_measured(c.argv, c.env)
            if k or not warmup:
                runs[name].append((seconds, base, rss, anon))
        loads.append(os.getloadavg()[0])
    return {
        name: {
            "seconds": round(statistics.median(r[0] for r in rs), 3),
            "floor_seconds": round(statistics.median(r[1] for r in rs), 3),
            "seconds_above_import_floor": round(statistics.median(r[0] - r[1] for r in rs), 3),
            "above_per_round": [round(r[0] - r[1], 3) for r in rs],
            "seconds_per_round": [round(r[0], 3) for r in rs],
            "peak_rss_mib": round(max(r[2] for r in rs)),
            "peak_anon_rss_mib": round(max(r[3] for r in rs)),
            "load_average": [round(x, 1) for x in loads],
        }
        for name, rs in runs.items()
    }


def ratio(rows: dict[str, Any], a: str, b: str, key: str = "seconds_per_round") -> float | None:
    """Median of the per-round ratios a / b (same rounds, so load hits both alike)."""
    if a not in rows or b not in rows:
        return None
    pairs = zip(rows[a][key], rows[b][key], strict=True)
    return round(float(statistics.median(x / y for x, y in pairs if y > 0)), 2)


# ---- sections ----------------------------------------------------------------------------------


def _quantize(
    tree: Path | None, args: list[str], numba: bool = True
) -> tuple[list[str], dict[str, str]]:
    return qtool_command(args, numba), tree_env(tree)


def bench_end_to_end(workdir: Path, gib: float, repeat: int, before: Path | None) -> dict[str, Any]:
    """A --gib fp32 checkpoint, int8 per channel: qtool (auto, and with numba hidden) against
    cp, a naive load-all quantizer, a 2x checkpoint, and the --before tree alike."""
    src, big = workdir / "model.safetensors", workdir / "model-2x.safetensors"
    write_checkpoint(src, gib)
    write_checkpoint(big, 2 * gib)
    out = workdir / "q.safetensors"
    outputs = (out, workdir / "q.qparams.safetensors")
    commands: dict[str, Command] = {
        "cp": Command(
            ["cp", str(src), str(workdir / "copy.safetensors")],
            src,
            outputs=(workdir / "copy.safetensors",),
        ),  # fmt: skip
    }
    trees = {"": None} | ({" (before)": before} if before else {})
    for label, tree in trees.items():
        for numba in (True, False):
            argv, env = _quantize(tree, ["quantize", "--force", "-o", str(out), str(src)], numba)
            name = "qtool quantize" + ("" if numba else ", numba hidden") + label
            commands[name] = Command(argv, src, env, outputs)
    argv, env = _quantize(
        None, ["quantize", "--force", "-o", str(workdir / "q2.safetensors"), str(big)]
    )
    commands["qtool quantize (2x checkpoint)"] = Command(
        argv, big, env, (workdir / "q2.safetensors", workdir / "q2.qparams.safetensors")
    )
    naive = [sys.executable, "-c", NAIVE, str(src), str(workdir / "naive.safetensors")]
    commands["naive load-all/save_file"] = Command(
        naive, src, outputs=(workdir / "naive.safetensors",)
    )
    rows = paired(commands, repeat)
    size = src.stat().st_size
    for name, row in rows.items():
        nbytes = 2 * size if "2x" in name else size
        above = row["seconds"] if name == "cp" else row["seconds_above_import_floor"]
        row["s_per_gib_above_floor"] = round(above / (nbytes / GiB), 3)
    src.unlink()
    big.unlink()
    return {"checkpoint_bytes": size, "runs": rows}


SMOL_ARGS = ["--format", "compressed-tensors", "--dtype", "int4", "--group-size", "64"]


def bench_models(
    workdir: Path,
    repeat: int,
    before: Path | None,
    llmc: Path | None,
    smol_config: Path | None,
    minilm: Path | None,
) -> dict[str, Any]:
    """The SmolLM2-shaped bf16 model exported as compressed-tensors int4 g64 (min-max and mse)
    by qtool, the --before tree and llm-compressor's model_free_ptq; MiniLM with --range mse."""
    smol = workdir / "smol"
    nbytes = write_smol(smol, smol_config)
    commands: dict[str, Command] = {}
    trees = {"": None} | ({" (before)": before} if before else {})
    for label, tree in trees.items():
        for method in ("minmax", "mse"):
            out = workdir / f"ct-{method}{label.strip(' ()')}"
            args = ["quantize", str(smol), *SMOL_ARGS, "--range", method, "-o", str(out), "--force"]
            argv, env = _quantize(tree, args)
            commands[f"qtool ct int4 g64 {method}{label}"] = Command(argv, smol, env, (out,))
    if llmc is not None:  # its mse observers fail data-free ("item() ... on meta tensors")
        out = workdir / "llmc-minmax"
        argv = llmc_command(llmc, smol, out, "minmax")
        commands["model_free_ptq int4 g64 minmax"] = Command(argv, smol, {}, (out,))
    if minilm is not None and minilm.is_file():
        for label, tree in trees.items():
            out = workdir / f"minilm{label.strip(' ()')}.safetensors"
            args = ["quantize", str(minilm), "--range", "mse", "-o", str(out), "--force"]
            argv, env = _quantize(tree, args)
            commands[f"qtool MiniLM int8 mse{label}"] = Command(argv, minilm, env, (out,))
    rows = paired(commands, repeat)
    return {"smol_bytes": nbytes, "runs": rows}


def bench_growth(
    workdir: Path, max_gib: float, repeat: int, shard_gib: float
) -> list[dict[str, Any]]:
    """`qtool quantize` (auto) of fp32 checkpoints from 64 MiB to max_gib, one file and sharded
    (shards of shard_gib), paired with the import floor; sizes the disk cannot hold (input and
    output, with 2 GiB to spare) are skipped and say so."""
    rows: list[dict[str, Any]] = []
    for gib in sweep_sizes(max_gib):
        for sharded in (False, True):
            need = int(gib * GiB * 1.3) + 2 * GiB
            if free_bytes(workdir) < need:
                free = free_bytes(workdir) / GiB
                skipped = f"needs {need / GiB:.1f} GiB, {free:.1f} free"
                rows.append({"gib": gib, "sharded": sharded, "skipped": skipped})
                continue
            src = workdir / ("sweep-dir" if sharded else "sweep.safetensors")
            size = write_checkpoint(src, gib, shard_gib if sharded else None)
            out = workdir / ("q-sweep-dir" if sharded else "q-sweep.safetensors")
            args = ["quantize", "--force", "-o", str(out), str(src)]
            argv, env = _quantize(None, args)
            outputs = (out, workdir / "q-sweep.qparams.safetensors")
            name = "sharded" if sharded else "one file"
            row = paired({name: Command(argv, src, env, outputs)}, repeat, warmup=False)[name]
            above = row["seconds_above_import_floor"]
            per_gib = round(above / (size / GiB), 3)
            rows.append({"gib": round(size / GiB, 3), "sharded": sharded, **row,
                         "s_per_gib_above_floor": per_gib})  # fmt: skip
            print(f"growth {size / GiB:.3f} GiB {name}: {above} s above the floor, "
                  f"peak anon {row['peak_anon_rss_mib']} MiB", flush=True)  # fmt: skip
            for p in (src, *outputs):
                _remove(p)
    return rows


RENDER = """
import io, sys, time
from qtool.results import ErrorStats, QuantizeRow, QuantizeSummary
from qtool.spec import QSpec
from qtool.report import console
stats = ErrorStats(884736, 1.06, 884.7, 0.0118)
rows = [QuantizeRow(f"model.layers.{i // 9}.mlp.up_proj{i % 9}.weight", (1536, 576), "BF16",
                    "I32", True, "sym int4 group 64 (1536x9 groups)", 1769472, 442368, stats)
        for i in range(272)]
summary = QuantizeSummary(inputs=["m"], outputs=["o"], rows=rows, spec=QSpec(), device="cpu",
                          dry_run=False)
times = []
for _ in range(5):
    t = time.perf_counter()
    console.print_quantize(summary)
    times.append(time.perf_counter() - t)
print(sorted(times)[2], file=sys.stderr)
"""


def bench_render(before: Path | None, repeat: int) -> dict[str, Any]:
    """print_quantize of 272 rows (SmolLM2's count) to a pipe, in process, median of 5 calls in
    each of `repeat` fresh processes, this tree and the --before tree in turn."""
    trees = {"after": None} | ({"before": before} if before else {})
    times: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(repeat):
        for name, tree in trees.items():
            env = {**os.environ, **tree_env(tree), "COLUMNS": "100"}
            cmd = [sys.executable, "-c", RENDER]
            done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            times[name].append(float(done.stderr.strip().splitlines()[-1]))
    return {name: round(statistics.median(ts), 4) for name, ts in times.items()} | {
        "load": round(os.getloadavg()[0], 1)
    }
