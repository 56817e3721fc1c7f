"""`qtool calibrate MODEL -o FILE`: a float model run over calibration text one decoder block at
a time; the sum of squared inputs per input column of every Linear, and the token rows, written
as llama.cpp's GGUF importance matrix. `--merge A B ... -o C` adds such files together
(docs/calibration.md)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from qtool.cli.app import app
from qtool.cli.errors import user_errors
from qtool.cli.help import DEBUG_ENV, INPUT, OUTPUT, RUN, Command, choices, epilog
from qtool.cli.lazy import api, lazy_module, report
from qtool.cli.options import JsonOpt
from qtool.cli.quantize_options import MAX_THREADS, thread_count
from qtool.errors import UsageError
from qtool.spec import Device

if TYPE_CHECKING:
    from qtool.report import calibrate_console as calibrate_report
    from qtool.report import calibrate_json
else:
    calibrate_report = lazy_module("qtool.report.calibrate_console")
    calibrate_json = lazy_module("qtool.report.calibrate_json")


def _at_least(least: int) -> Callable[[int | None], int | None]:
    def check(value: int | None) -> int | None:
        if value is not None and value < least:
            raise typer.BadParameter(f"must be at least {least}, got {value}")
        return value

    return check


@contextmanager
def _kept() -> Iterator[list[str]]:
    """The run's warnings, shown on stderr as ever once it ends; qtool's own kept for the JSON's
    `warnings`."""
    kept: list[str] = []
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            yield kept
    finally:  # before an error's line too
        for w in caught:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
            if w.category.__module__.split(".")[0] == "qtool":
                kept.append(" ".join(str(w.message).split()))


InputsArg = Annotated[
    list[Path],
    typer.Argument(
        metavar="MODEL",
        help="The float model: a Hugging Face model directory of the Llama family (config.json, "
        "safetensors weights, tokenizer), its mixture-of-experts models included (Mixtral, "
        "Qwen2-MoE, Qwen3-MoE: one entry per stacked expert weight); with --merge, the "
        "importance matrices to add (GGUF or llama.cpp's legacy .dat).",
        show_default=False,
    ),
]
OutOpt = Annotated[
    Path,
    typer.Option(
        "--out",
        "-o",
        help="The importance matrix to write (llama.cpp's GGUF imatrix, e.g. model.imatrix.gguf).",
        metavar="FILE",
        show_default=False,
        rich_help_panel=OUTPUT,
    ),
]
TextOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--text",
        help="Calibration text: UTF-8, or JSONL (.jsonl: a 'text' string or chat 'messages' per "
        "line); repeat to mix several, a window from each in turn [default: the docstrings of "
        "CPython's standard library].",
        metavar="FILE",
        show_default=False,
        rich_help_panel=INPUT,
    ),
]
TokensOpt = Annotated[
    int,
    typer.Option(
        help="Tokens to run, in whole windows (rounded down to a multiple of --ctx).",
        callback=_at_least(1),
        metavar="N",
        rich_help_panel=INPUT,
    ),
]
CtxOpt = Annotated[
    int | None,
    typer.Option(
        help="Window length in tokens; windows do not overlap [default: 512, or the model's "
        "max_position_embeddings if smaller].",
        callback=_at_least(1),
        metavar="N",
        show_default=False,
        rich_help_panel=INPUT,
    ),
]
ForceOpt = Annotated[  # one file out: the shared text's "output directory" is not calibrate's
    bool,
    typer.Option("--force", help="Replace an existing --out file.", rich_help_panel=OUTPUT),
]
MergeOpt = Annotated[
    bool,
    typer.Option(
        "--merge",
        help="Add the importance matrices given as MODEL into --out (sums and counts added, as "
        "llama-imatrix --in-file does).",
        rich_help_panel=INPUT,
    ),
]
SensitivityOpt = Annotated[
    bool,
    typer.Option(
        "--sensitivity",
        help="Also measure each Linear's alpha (the model's KL per unit of its output error, "
        "for --target-kl and --target-size) and write it into the file as metadata "
        "(docs/calibration.md); one forward per Linear from its block on: slow.",
        rich_help_panel=INPUT,
    ),
]
SENSITIVITY_TOKENS = 2 * 512
SensitivityTokensOpt = Annotated[
    int | None,
    typer.Option(
        help="With --sensitivity: the tokens (the first whole windows of the calibration text, "
        f"at most --tokens) each Linear's KL is measured on [default: {SENSITIVITY_TOKENS}].",
        callback=_at_least(1),
        metavar="N",
        show_default=False,
        rich_help_panel=INPUT,
    ),
]
DeviceOpt = Annotated[
    Device,
    typer.Option(
        help="Where the blocks run: the CPU unless asked (auto: CUDA when available, else the "
        "CPU; quantize and eval default to auto).",
        metavar=choices(Device),
        rich_help_panel=RUN,
    ),
]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        help=f"CPU threads for the forward passes, 1 to {MAX_THREADS} [default: the idle cores].",
        callback=thread_count,
        metavar="N",
        show_default=False,
        rich_help_panel=RUN,
    ),
]


@app.command(
    cls=Command,
    short_help="Run a float model over text and write its importance matrix for llama.cpp.",
    epilog=epilog("qtool calibrate models/llama --text calib.txt -o llama.imatrix.gguf", DEBUG_ENV),
)
def calibrate(
    inputs: InputsArg,
    out: OutOpt,
    text: TextOpt = None,
    tokens: TokensOpt = 128 * 512,
    ctx: CtxOpt = None,
    merge: MergeOpt = False,
    sensitivity: SensitivityOpt = False,
    sensitivity_tokens: SensitivityTokensOpt = None,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
    device: DeviceOpt = Device.CPU,
    threads: ThreadsOpt = None,
) -> None:
    """Run MODEL over calibration text one decoder block at a time and write, for every Linear
    of every block, the sum of squared inputs per input column and the number of token rows:
    llama.cpp's GGUF importance matrix (llama-quantize --imatrix), named as llama.cpp names the
    model's tensors. With --merge, add importance matrices together instead."""
    if sensitivity_tokens is not None and not sensitivity:
        raise typer.BadParameter("goes only with --sensitivity", param_hint="--sensitivity-tokens")
    with user_errors(as_json), _kept() as warned:
        if out.suffix.lower() == ".dat":  # the bytes would be GGUF under a legacy .dat name
            raise UsageError(out, "qtool writes the GGUF imatrix, not llama.cpp's legacy .dat; "
                             "name it .gguf (llama-quantize --imatrix reads it)")  # fmt: skip
        if merge:
            summary = api.merge_imatrices(inputs, out, force)
        else:
            if len(inputs) != 1:
                raise UsageError(None, f"calibrate runs one MODEL, got {len(inputs)}; to add "
                                 "importance matrices, pass --merge")  # fmt: skip
            measure = (sensitivity_tokens or SENSITIVITY_TOKENS) if sensitivity else 0
            with calibrate_report.calibrate_progress() as progress:
                result = api.calibrate(inputs[0], out, tuple(text or ()), tokens, ctx,
                                       device.value, force, threads, progress,
                                       measure)  # fmt: skip
    if merge:
        if as_json:
            report.print_json(calibrate_json.merge_json(summary) | {"warnings": warned})
        else:
            calibrate_report.print_merge(summary)
        return
    asked = tokens // result.ctx * result.ctx
    if result.tokens < asked:  # the JSON's tokens and windows say what ran
        gave, windows = (calibrate_report.counted(result.tokens, "token"),
                         calibrate_report.counted(result.windows, "window"))  # fmt: skip
        warned.append(f"the calibration text gave {gave} of the {asked:,} asked for: "
                      f"{windows} of {result.ctx}")  # fmt: skip
        report.print_warning(warned[-1])
    measured = result.sensitivity
    if sensitivity_tokens is not None and measured and sensitivity_tokens > result.tokens:
        warned.append(f"--sensitivity-tokens {sensitivity_tokens:,} is more than the "
                      f"{result.tokens:,} calibration tokens: the sensitivity was measured on "
                      f"{measured.tokens:,} (capped; raise --tokens for more)")  # fmt: skip
        report.print_warning(warned[-1])
    if as_json:
        report.print_json(calibrate_json.calibrate_json(result) | {"warnings": warned})
    else:
        calibrate_report.print_calibrate(result)
