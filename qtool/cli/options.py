"""The command line's options, declared once and shared by the commands: their types, help
texts and checks (a contradiction is a usage error, exit 2, before anything is read)."""

from __future__ import annotations

import math
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from qtool.spec import (
    Device,
    FormatName,
    Granularity,
    GroupFallback,
    PerChannel,
    PerGroup,
    PerTensor,
    QSpec,
    RangeMethod,
    Scheme,
    StorageDtype,
)


class OutDtype(str, Enum):
    ORIGINAL = "original"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class SortKey(str, Enum):
    NAME = "name"
    MSE = "mse"
    SQNR = "sqnr"
    SIZE = "size"


class Pool(str, Enum):
    """What compare's overall figures pool (results.CompareSummary.pooled_over)."""

    QUANTIZED = "quantized"
    ALL = "all"


def thread_count(value: int | None) -> int | None:
    if value is not None and not 1 <= value <= MAX_THREADS:
        raise typer.BadParameter(f"must be 1 to {MAX_THREADS}")
    return value


def _at_least_one(value: int | None) -> int | None:
    """Typer's own `min=1` would print `[x>=1]` in the help; the check is the same."""
    if value is not None and value < 1:
        raise typer.BadParameter("must be at least 1")
    return value


def _finite_bound(value: float | None) -> float | None:
    """Gate bounds are finite numbers: nan would pass everything, inf means no bound."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number; give a finite bound")
    return value


def _mse_bound(value: float | None) -> float | None:
    value = _finite_bound(value)
    if value is not None and value < 0:
        raise typer.BadParameter(f"{value} is negative; an MSE bound is >= 0 (0: exact)")
    return value


JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Replace existing output files (an output directory: only a previous qtool export).",
    ),
]
MaxMseOpt = Annotated[
    float | None,
    typer.Option(
        help="Gate: fail (exit 3) if any tensor's MSE is above this.",
        show_default=False,
        callback=_mse_bound,
    ),
]
MinSqnrOpt = Annotated[
    float | None,
    typer.Option(
        help="Gate: fail (exit 3) if any tensor's SQNR (dB) is below this.",
        show_default=False,
        callback=_finite_bound,
    ),
]
TargetSqnrOpt = Annotated[
    float | None,
    typer.Option(
        "--target-sqnr",
        help="Error budget: per tensor, the cheapest ladder spec whose SQNR reaches DB, "
        "else float (with --dry-run, add --estimate).",
        metavar="DB",
        show_default=False,
        callback=_finite_bound,
    ),
]
MinOverallOpt = Annotated[
    float | None,
    typer.Option(
        help="Gate: fail (exit 3) if the pooled SQNR (dB) is below this.",
        show_default=False,
        callback=_finite_bound,
    ),
]
PoolOpt = Annotated[
    Pool,
    typer.Option(
        "--pool",
        help="What the overall SQNR pools: the tensors restored from codes (as quantize "
        "pools them), or all compared tensors (kept ones count at zero error).",
    ),
]
SortOpt = Annotated[
    SortKey | None,
    typer.Option(
        help="Order rows: name, mse/sqnr (worst first), size (largest first) "
        "[default: file order].",
        show_default=False,
    ),
]
TopOpt = Annotated[
    int | None,
    typer.Option(
        help="Show only the first N rows (after --sort).",
        callback=_at_least_one,
        metavar="N",
        show_default=False,
    ),
]
TABLE_MAX_ROWS = 1000  # a longer table shows only its TRIMMED_ROWS worst rows unless asked
TRIMMED_ROWS = 50
AllOpt = Annotated[
    bool,
    typer.Option(
        "--all",
        help=f"Show every row in the table (a table of over {TABLE_MAX_ROWS} rows shows its "
        f"{TRIMMED_ROWS} worst unless --top or --all says otherwise; --json has every row).",
    ),
]
PlotOpt = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        help="Also draw per-layer SQNR and the worst layers' error histograms to this PNG "
        "(needs qtool[plot]).",
        show_default=False,
    ),
]
SchemeOpt = Annotated[
    Scheme,
    typer.Option(
        help="sym: scale from max|x| (max|x|/127 for 8-bit), zero point fixed; "
        "asym: affine over [min, max]."
    ),
]
DtypeOpt = Annotated[
    StorageDtype,
    typer.Option(help="Integer type of the codes; int4/uint4 are packed two per byte."),
]
PerChannelOpt = Annotated[
    bool,
    typer.Option(
        "--per-channel/--per-tensor", help="One scale per channel along --axis, or one per tensor."
    ),
]
AxisOpt = Annotated[
    int | None,
    typer.Option(
        help="Channel axis for --per-channel (negative counts from the end) [default: 0].",
        show_default=False,
    ),
]
GroupSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--group-size",
        metavar="G",
        help="One scale per G consecutive elements of each row (the input dimension of a "
        "Linear weight), e.g. 128 or 32. G >= 2.",
        show_default=False,
    ),
]
RangeOpt = Annotated[
    RangeMethod,
    typer.Option(
        "--range",
        help="minmax: the full range of each group; mse: the clipped or stretched range with "
        "the least squared error (never worse than minmax).",
    ),
]
MAX_THREADS = 1024  # torch's thread pools crash (SIGSEGV) when asked for ~100,000 threads


def quantize_mode(dry_run: bool, estimate: bool, gated: bool, budget: bool) -> str:
    """The run --dry-run and --estimate ask for (plan, estimate or write; qtool.api.Mode);
    typer.BadParameter (exit 2) for one that cannot do what the other options need."""
    if estimate and not dry_run:
        raise typer.BadParameter("goes only with --dry-run", param_hint="--estimate")
    if dry_run and not estimate and gated:
        raise typer.BadParameter(
            "a gate needs error figures, which a plain dry run does not compute; "
            "add --estimate (or drop --dry-run)",
            param_hint="--dry-run",
        )
    if dry_run and not estimate and budget:
        raise typer.BadParameter(
            "the error budget measures each tensor, which a plain dry run does not; "
            "add --estimate (or drop --dry-run)",
            param_hint="--target-sqnr",
        )
    return "estimate" if estimate else "plan" if dry_run else "write"


def check_format_options(fmt: FormatName, config: Path | None, fallback: GroupFallback) -> None:
    """--config and --group-fallback only mean something to compressed-tensors."""
    if fmt is FormatName.QTOOL and (config is not None or fallback is not GroupFallback.ERROR):
        raise typer.BadParameter(
            "--config and --group-fallback go with --format compressed-tensors",
            param_hint="--format",
        )


def build_spec(
    scheme: Scheme,
    dtype: StorageDtype,
    per_channel: bool,
    axis: int | None,
    group_size: int | None,
    range_method: RangeMethod,
) -> QSpec:
    """The QSpec the options describe; typer.BadParameter (exit 2) for a contradiction."""
    if not per_channel and axis is not None:
        raise typer.BadParameter("goes with --per-channel, not --per-tensor", param_hint="--axis")
    if group_size is None:
        granularity: Granularity = PerChannel(axis or 0) if per_channel else PerTensor()
        return QSpec(scheme, dtype, granularity, range_method)
    if group_size < 2:
        raise typer.BadParameter(f"must be at least 2, got {group_size}", param_hint="--group-size")
    if not per_channel:
        raise typer.BadParameter(
            "groups are not per tensor; drop --per-tensor", param_hint="--group-size"
        )
    if axis not in (None, 0):
        raise typer.BadParameter(
            "groups run along the rows of the first dimension; drop --axis",
            param_hint="--group-size",
        )
    return QSpec(scheme, dtype, PerGroup(group_size), range_method)


# -- quantize --------------------------------------------------------------------------------------

InputArg = Annotated[
    Path,
    typer.Argument(
        metavar="INPUT",
        help="Checkpoint: .safetensors, a .pt/.pth/.bin state dict, "
        "or a sharded checkpoint (its *.safetensors.index.json or directory).",
        show_default=False,
    ),
]

QuantizeOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        help="Output .safetensors file, or an existing directory to put the default name in "
        "(for sharded input, and for --format compressed-tensors: the output directory) "
        "[default: INPUT-STEM.DTYPE.safetensors beside the input].",
        show_default=False,
    ),
]

IncludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--include",
        help="Glob of tensor names to quantize (repeatable); also selects 1-D tensors.",
        metavar="GLOB",
        show_default=False,
    ),
]

ExcludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--exclude",
        help="Glob of tensor names to keep as they are (repeatable; tried first, see "
        "docs/recipes.md for the order).",
        metavar="GLOB",
        show_default=False,
    ),
]

RecipeOpt = Annotated[
    Path | None,
    typer.Option(
        "--recipe",
        help="TOML file of per-tensor rules: a spec or keep-in-float per name pattern.",
        metavar="FILE",
        show_default=False,
    ),
]

FormatOpt = Annotated[
    FormatName,
    typer.Option(
        "--format",
        help="qtool: codes plus a qparams sidecar. compressed-tensors: a model directory "
        "(pack-quantized) that transformers and vLLM load; needs -o DIR.",
    ),
]

ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="The model's config.json, for --format compressed-tensors from a single "
        ".safetensors file [default: INPUT/config.json for a model directory].",
        metavar="PATH",
        show_default=False,
    ),
]

GroupFallbackOpt = Annotated[
    GroupFallback,
    typer.Option(
        "--group-fallback",
        help="compressed-tensors, when --group-size does not divide a tensor's row length: "
        "error (name them), channel (those per channel) or keep (those in float).",
    ),
]

DeviceOpt = Annotated[
    Device, typer.Option(help="Where the kernels run; auto picks CUDA when available.")
]

KeepNonfiniteOpt = Annotated[
    bool,
    typer.Option(
        "--keep-nonfinite", help="Keep tensors holding NaN/Inf unquantized instead of failing."
    ),
]

DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run", help="Print what would be done (from headers only) and write nothing."
    ),
]

EstimateOpt = Annotated[
    bool,
    typer.Option(
        "--estimate",
        help="With --dry-run: also compute the error figures (reads the data, writes nothing).",
    ),
]

ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        help=f"CPU threads for the kernels, 1 to {MAX_THREADS} [default: all cores].",
        callback=thread_count,
        metavar="N",
        show_default=False,
    ),
]
