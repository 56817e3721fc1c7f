"""`qtool dequantize`: a quantized checkpoint back to a float one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app
from qtool.cli.errors import user_errors
from qtool.cli.help import DEBUG_ENV, INPUT, KERNEL_ENV, OUTPUT, Command, epilog
from qtool.cli.inputs import DEQUANTIZE_INPUT
from qtool.cli.lazy import api, documents, report
from qtool.cli.options import ForceOpt, JsonOpt, OutDtype
from qtool.cli.render import print_notes, shown_progress

QuantizedArg = Annotated[
    Path, typer.Argument(metavar="QUANTIZED", help=DEQUANTIZE_INPUT, show_default=False)
]
OutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        help="Output .safetensors, or .pt/.pth/.bin (torch.save), or for a GGUF a float .gguf "
        "(which quantize --format gguf takes), or an existing directory "
        "[default: QUANTIZED-STEM.dequantized.safetensors].",
        metavar="PATH",
        show_default=False,
        rich_help_panel=OUTPUT,
    ),
]
QparamsOpt = Annotated[
    Path | None,
    typer.Option(
        "--qparams",
        help="The sidecar, when it was moved [default: QUANTIZED-STEM.qparams.safetensors "
        "beside it].",
        metavar="PATH",
        show_default=False,
        rich_help_panel=INPUT,
    ),
]
ToOpt = Annotated[
    OutDtype | None,
    typer.Option(
        "--to",
        help="Float type of every float tensor written (also f32, f16, bf16) [default: original].",
        metavar="original|float32|float16|bfloat16",
        show_default=False,
        rich_help_panel=OUTPUT,
    ),
]
OldDtypeOpt = Annotated[  # the spelling before --to (quantize's --dtype means the code type)
    OutDtype | None, typer.Option("--dtype", hidden=True, show_default=False)
]


@app.command(
    cls=Command,
    short_help="Turn a quantized checkpoint back into a float one.",
    epilog=epilog(
        "qtool dequantize model.int8.safetensors -o model.restored.safetensors",
        KERNEL_ENV,
        DEBUG_ENV,
    ),
)
def dequantize(
    src: QuantizedArg,
    out: OutOpt = None,
    qparams: QparamsOpt = None,
    to: ToOpt = None,
    old_dtype: OldDtypeOpt = None,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Turn a quantized checkpoint back into a float one with the original names and dtypes."""
    dtype = _restore_dtype(to, old_dtype)
    with user_errors(as_json):
        with shown_progress(as_json) as progress:
            summary = api.dequantize(
                src, out, qparams=qparams, dtype=dtype, force=force, progress=progress
            )
        print_notes(summary.notes)
    if as_json:
        report.print_json(documents.dequantize_json(summary))
    else:
        report.print_dequantize(summary)


def _restore_dtype(to: OutDtype | None, old_dtype: OutDtype | None) -> str:
    if to is not None and old_dtype is not None and to.canonical != old_dtype.canonical:
        raise typer.BadParameter(
            f"{to.value} disagrees with --dtype {old_dtype.value} (the old name of --to); "
            "give one of them",
            param_hint="--to",
        )
    return (to or old_dtype or OutDtype.ORIGINAL).canonical
