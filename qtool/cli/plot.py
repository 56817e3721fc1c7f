"""`qtool plot`: one tensor quantized in memory, drawn as heatmaps and a histogram (PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app
from qtool.cli.errors import user_errors
from qtool.cli.help import DEBUG_ENV, OUTPUT, SELECT, Command, epilog
from qtool.cli.inputs import PLOT_INPUT
from qtool.cli.lazy import api, documents, report
from qtool.cli.options import (
    AxisOpt,
    DtypeOpt,
    ForceOpt,
    GroupSizeOpt,
    JsonOpt,
    PerChannelOpt,
    RangeOpt,
    SchemeOpt,
    build_spec,
)
from qtool.spec import RangeMethod, Scheme, StorageDtype

CheckpointArg = Annotated[
    Path, typer.Argument(metavar="CHECKPOINT", help=PLOT_INPUT, show_default=False)
]
TensorOpt = Annotated[
    str,
    typer.Option(
        "--tensor",
        "-t",
        help="Name of the tensor to draw (qtool inspect lists them).",
        metavar="NAME",
        show_default=False,
        rich_help_panel=SELECT,
    ),
]
PngOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        help="PNG file, or an existing directory "
        "[default: CHECKPOINT-STEM.TENSOR.png beside the checkpoint].",
        metavar="FILE.png",
        show_default=False,
        rich_help_panel=OUTPUT,
    ),
]


@app.command(
    cls=Command,
    short_help="Draw one tensor quantized: heatmaps and a value histogram (PNG).",
    epilog=epilog(
        "qtool plot model.safetensors --tensor layers.0.fc1.weight -o fc1.png", DEBUG_ENV
    ),
)
def plot(
    checkpoint: CheckpointArg,
    tensor: TensorOpt,
    out: PngOpt = None,
    scheme: SchemeOpt = Scheme.SYM,
    dtype: DtypeOpt = StorageDtype.INT8,
    per_channel: PerChannelOpt = True,
    axis: AxisOpt = None,
    group_size: GroupSizeOpt = None,
    range_method: RangeOpt = RangeMethod.MINMAX,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Draw one tensor of a float checkpoint: original, integer codes, reconstruction and error
    heatmaps, and a histogram of its values with the quantization grid's range marked."""
    spec = build_spec(scheme, dtype, per_channel, axis, group_size, range_method)
    with user_errors(as_json):
        default = api.default_tensor_plot_path(checkpoint, tensor)
        target = api.output_path(out, default, (".png",), "plot")
        info = api.plot_tensor(checkpoint, tensor, spec, target, force=force)
    if as_json:
        report.print_json(documents.plot_json(str(checkpoint), str(target), info))
    else:
        report.print_line(f"wrote {target} ({info['spec']}, SQNR {info['sqnr_db']:.1f} dB)")
