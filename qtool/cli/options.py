"""The command line's options, declared once and shared by the commands: their types, help
texts and checks (a contradiction is a usage error, exit 2, before anything is read)."""

from __future__ import annotations

import math
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from qtool.spec import (
    Granularity,
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
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace existing output files.")]
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
