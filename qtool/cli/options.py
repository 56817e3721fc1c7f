"""The options several commands share, declared once: their types, help texts, panels and
checks (a contradiction is a usage error, exit 2, before anything is read). The options of
quantize alone are in cli/quantize_options.py; the help layout in cli/help.py."""

from __future__ import annotations

import math
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.help import GATES, HOW, OUTPUT, REPORT, choices
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
    F32 = "f32"  # the short spellings (llama.cpp's, GGUF's) of the same three
    F16 = "f16"
    BF16 = "bf16"

    @property
    def canonical(self) -> str:
        return _SHORT_DTYPES.get(self.value, self.value)


_SHORT_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


class SortKey(str, Enum):
    NAME = "name"
    MSE = "mse"
    SQNR = "sqnr"
    SIZE = "size"


class Pool(str, Enum):
    """What compare's overall figures pool (results.CompareSummary.pooled_over)."""

    QUANTIZED = "quantized"
    ALL = "all"


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


# -- output and report ---------------------------------------------------------------------------

JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print one JSON document on stdout instead of tables.",
        rich_help_panel=REPORT,
    ),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Replace existing output files (an output directory: only a previous qtool export).",
        rich_help_panel=OUTPUT,
    ),
]
SortOpt = Annotated[
    SortKey | None,
    typer.Option(
        help="Order rows: name, mse/sqnr (worst first), size (largest first) "
        "[default: file order].",
        metavar=choices(SortKey),
        show_default=False,
        rich_help_panel=REPORT,
    ),
]
TopOpt = Annotated[
    int | None,
    typer.Option(
        help="Show only the N worst rows (lowest SQNR), or the first N in --sort's order; --all "
        "overrides it.",
        callback=_at_least_one,
        metavar="N",
        show_default=False,
        rich_help_panel=REPORT,
    ),
]
TABLE_MAX_ROWS = 1000  # a longer table shows only its TRIMMED_ROWS worst rows unless asked
TRIMMED_ROWS = 50
AllOpt = Annotated[
    bool,
    typer.Option(
        "--all",
        help=f"Show every row, whatever --top says (a table of over {TABLE_MAX_ROWS} rows "
        f"shows its {TRIMMED_ROWS} worst otherwise; --json has every row unless --top).",
        rich_help_panel=REPORT,
    ),
]
PlotOpt = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        help="Also draw per-layer SQNR and the worst layers' error histograms to this PNG "
        "(needs qtool[plot]).",
        metavar="FILE.png",
        show_default=False,
        rich_help_panel=REPORT,
    ),
]

# -- quality gates -------------------------------------------------------------------------------

MaxMseOpt = Annotated[
    float | None,
    typer.Option(
        help="Fail if any tensor's MSE is above X (0: exact).",
        metavar="X",
        show_default=False,
        callback=_mse_bound,
        rich_help_panel=GATES,
    ),
]
MinSqnrOpt = Annotated[
    float | None,
    typer.Option(
        help="Fail if any tensor's SQNR is below DB decibels.",
        metavar="DB",
        show_default=False,
        callback=_finite_bound,
        rich_help_panel=GATES,
    ),
]
MinOverallOpt = Annotated[
    float | None,
    typer.Option(
        help="Fail if the overall SQNR (by default pooled over the quantized tensors) is "
        "below DB decibels.",
        metavar="DB",
        show_default=False,
        callback=_finite_bound,
        rich_help_panel=GATES,
    ),
]
PoolOpt = Annotated[
    Pool,
    typer.Option(
        "--pool",
        help="What the overall SQNR pools: the tensors restored from codes (as quantize "
        "pools them), or all compared tensors (kept ones count at zero error).",
        metavar=choices(Pool),
        rich_help_panel=GATES,
    ),
]

# -- the spec (quantize and plot) ----------------------------------------------------------------

SchemeOpt = Annotated[
    Scheme,
    typer.Option(
        help="sym: scale from max|x| (max|x|/127 for 8-bit), zero point fixed; "
        "asym: affine over [min, max].",
        metavar=choices(Scheme),
        rich_help_panel=HOW,
    ),
]
DtypeOpt = Annotated[
    StorageDtype,
    typer.Option(
        help="Integer type of the codes; int4/uint4 are packed two per byte.",
        metavar=choices(StorageDtype),
        rich_help_panel=HOW,
    ),
]
PerChannelOpt = Annotated[
    bool,
    typer.Option(
        "--per-channel/--per-tensor",
        help="One scale per channel along --axis, or one per tensor.",
        rich_help_panel=HOW,
    ),
]
AxisOpt = Annotated[
    int | None,
    typer.Option(
        help="Channel axis for --per-channel (negative counts from the end) [default: 0].",
        metavar="N",
        show_default=False,
        rich_help_panel=HOW,
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
        rich_help_panel=HOW,
    ),
]
RangeOpt = Annotated[
    RangeMethod,
    typer.Option(
        "--range",
        help="minmax: the full range of each group; mse: the clipped or stretched range with "
        "the least squared error (never worse than minmax).",
        metavar=choices(RangeMethod),
        rich_help_panel=HOW,
    ),
]


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
