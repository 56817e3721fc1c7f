"""`qtool compare`: the per-tensor error of B against A, as a table or JSON, with gates."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app
from qtool.cli.errors import user_errors
from qtool.cli.help import DEBUG_ENV, KERNEL_ENV, OUTPUT, Command, epilog
from qtool.cli.inputs import COMPARE_A, COMPARE_B
from qtool.cli.lazy import api, documents, report
from qtool.cli.options import (
    AllOpt,
    JsonOpt,
    MaxMseOpt,
    MinOverallOpt,
    MinSqnrOpt,
    PlotOpt,
    Pool,
    PoolOpt,
    SortOpt,
    TopOpt,
)
from qtool.cli.render import Shown, plot_target, show_and_gate, shown_progress

ReferenceArg = Annotated[Path, typer.Argument(metavar="A", help=COMPARE_A, show_default=False)]
ComparedArg = Annotated[Path, typer.Argument(metavar="B", help=COMPARE_B, show_default=False)]
PlotForceOpt = Annotated[
    bool,
    typer.Option("--force", help="Replace an existing --plot file.", rich_help_panel=OUTPUT),
]


@app.command(
    cls=Command,
    short_help="Per-tensor error between two checkpoints; gate a pipeline on it.",
    epilog=epilog(
        "qtool compare model.safetensors model.int8.safetensors --min-sqnr 35",
        KERNEL_ENV,
        DEBUG_ENV,
    ),
)
def compare(
    a: ReferenceArg,
    b: ComparedArg,
    max_mse: MaxMseOpt = None,
    min_sqnr: MinSqnrOpt = None,
    min_overall_sqnr: MinOverallOpt = None,
    pool: PoolOpt = Pool.QUANTIZED,
    sort: SortOpt = None,
    top: TopOpt = None,
    show_all: AllOpt = False,
    plot: PlotOpt = None,
    as_json: JsonOpt = False,
    force: PlotForceOpt = False,
) -> None:
    """Per-tensor error between two checkpoints sharing tensor names (quantized ones are
    dequantized on the fly; sharded sets shard by shard)."""
    from qtool.gates import Gate, evaluate

    with user_errors(as_json):
        plot = plot_target(plot, a, "compare")
        if plot is not None:
            api.check_outputs([plot], [a, b], force)
        with shown_progress(as_json) as progress:
            summary = api.compare(a, b, pool.value, progress)
        if plot is not None:
            api.plot_compare(summary, plot, min_sqnr, force=force)
            report.print_note(f"wrote {plot}")
    gate = evaluate(
        Gate(max_mse, min_sqnr, min_overall_sqnr), summary.rows, summary.overall,
        summary.mismatches,
    )  # fmt: skip
    show_and_gate(
        summary.rows,
        Shown(sort, top, show_all),
        gate,
        as_json,
        lambda rows: report.print_json(documents.compare_json(summary, rows, gate)),
        lambda rows: report.print_compare(summary, rows, gate),
    )
