"""`qtool inspect`: what a file holds, from its header (torch-free for safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app
from qtool.cli.errors import user_errors
from qtool.cli.help import DEBUG_ENV, Command, epilog
from qtool.cli.inputs import INSPECT_INPUT
from qtool.cli.lazy import api, documents, report
from qtool.cli.options import JsonOpt


@app.command(
    cls=Command,
    short_help="List the tensors of a checkpoint, quantized file or sidecar.",
    epilog=epilog("qtool inspect model.int8.safetensors --json | jq '.totals'", DEBUG_ENV),
)
def inspect(
    path: Annotated[Path, typer.Argument(metavar="PATH", help=INSPECT_INPUT, show_default=False)],
    as_json: JsonOpt = False,
) -> None:
    """List the tensors of a file; for quantized files and sidecars, how each was quantized."""
    with user_errors(as_json):
        summary = api.inspect(path)
    if as_json:
        report.print_json(documents.inspect_json(summary))
    else:
        report.print_inspect(summary)
