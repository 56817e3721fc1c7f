"""The options of `qtool quantize --method` (a calibrated method: docs/calibration.md), named as
`qtool calibrate` names its own (--text, --tokens, --ctx), and the checks between them and the
other options: a combination that cannot work is a usage error (exit 2) before anything is read."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.calibration import DEFAULT_TOKENS, Calibration, Guard, Method
from qtool.cli.help import GATES, HOW, choices
from qtool.spec import FormatName


def _at_least_one(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise typer.BadParameter(f"must be at least 1, got {value}")
    return value


def _tolerance(value: float | None) -> float | None:
    if value is not None and not 0.0 <= value < 1e6:  # also refuses nan
        raise typer.BadParameter(f"must be 0 or more (0.05: 5 %), got {value}")
    return value


def _ratio(value: float | None) -> float | None:
    if value is not None and not 0.0 < value < 1e6:  # also refuses nan and inf
        raise typer.BadParameter(f"must be above 0 (1: no worse than rounding), got {value}")
    return value


MethodOpt = Annotated[
    Method | None,
    typer.Option(
        "--method",
        help=f"Choose the codes with the model's own activations ({choices(Method)}): runs "
        "INPUT, a Hugging Face directory of the Llama family, one decoder block at a time over "
        "calibration text [default: round to nearest, no model run].",
        metavar="METHOD",
        show_default=False,
        rich_help_panel=HOW,
    ),
]
CalibTextOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--text",
        help="With --method: calibration text, as `qtool calibrate --text` (UTF-8, or JSONL); "
        "repeat to mix [default: the docstrings of CPython's standard library]. One window in "
        "8 is held out to check the result.",
        metavar="FILE",
        show_default=False,
        rich_help_panel=HOW,
    ),
]
CalibTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--tokens",
        help=f"With --method: calibration tokens, in whole windows [default: {DEFAULT_TOKENS}].",
        callback=_at_least_one,
        metavar="N",
        show_default=False,
        rich_help_panel=HOW,
    ),
]
CalibCtxOpt = Annotated[
    int | None,
    typer.Option(
        "--ctx",
        help="With --method: window length in tokens [default: 512, or the model's "
        "max_position_embeddings if smaller].",
        callback=_at_least_one,
        metavar="N",
        show_default=False,
        rich_help_panel=HOW,
    ),
]
CheckTextOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--check-text",
        help="With --method: text of another domain than --text, on which the method must not "
        "raise a Linear's output error beyond --tolerance [default: CPython's LICENSE.txt].",
        metavar="FILE",
        show_default=False,
        rich_help_panel=HOW,
    ),
]
GuardOpt = Annotated[
    Guard | None,
    typer.Option(
        "--guard",
        help="With --method: keep its codes for a Linear where they lower the output error on "
        "held-out windows and raise it on the check text by at most --tolerance (both), where "
        "they lower it on held-out windows (domain), or always (none) [default: both].",
        metavar=choices(Guard),
        show_default=False,
        rich_help_panel=HOW,
    ),
]
ToleranceOpt = Annotated[
    float | None,
    typer.Option(
        "--tolerance",
        help="With --guard both: the largest rise of a Linear's output error on the check text "
        "kept (0.05: 5 %) [default: 0.05].",
        callback=_tolerance,
        metavar="R",
        show_default=False,
        rich_help_panel=HOW,
    ),
]


MaxKlRatioOpt = Annotated[
    float | None,
    typer.Option(
        "--max-kl-ratio",
        help="With --method: fail if the model's KL against the float model, on the held-out "
        "windows or on the check text, is above R times round to nearest's on the same grid "
        "(1: calibration must not lose to rounding on either text).",
        callback=_ratio,
        metavar="R",
        show_default=False,
        rich_help_panel=GATES,
    ),
]


def check_kl_gate(method: Method | None, max_kl_ratio: float | None) -> None:
    """typer.BadParameter for --max-kl-ratio without --method (only a method measures it)."""
    if max_kl_ratio is not None and method is None:
        raise typer.BadParameter("goes only with --method (it measures the model's KL)",
                                 param_hint="--max-kl-ratio")  # fmt: skip


def calibration(
    method: Method | None,
    texts: list[Path] | None,
    tokens: int | None,
    ctx: int | None,
    check_texts: list[Path] | None,
    guard: Guard | None,
    tolerance: float | None,
) -> Calibration | None:
    """The method's options as one value (None: no method); typer.BadParameter naming an
    option given without --method."""
    given = {
        "--text": texts, "--tokens": tokens, "--ctx": ctx, "--check-text": check_texts,
        "--guard": guard, "--tolerance": tolerance,
    }  # fmt: skip
    if method is None:
        flag = next((f for f, v in given.items() if v is not None), None)
        if flag is not None:
            raise typer.BadParameter("goes only with --method", param_hint=flag)
        return None
    if tolerance is not None and guard not in (None, Guard.BOTH):
        raise typer.BadParameter(f"means nothing with --guard {guard.value}",
                                 param_hint="--tolerance")  # fmt: skip
    defaults = Calibration()
    return Calibration(
        method,
        tuple(texts or ()),
        tokens if tokens is not None else defaults.tokens,
        ctx,
        tuple(check_texts or ()),
        guard or defaults.guard,
        tolerance if tolerance is not None else defaults.tolerance,
    )


def check_method(
    calibration: Calibration | None, fmt: str, integer_grid: bool, target_sqnr: float | None,
    dry_run: bool, estimate: bool,
) -> None:  # fmt: skip
    """typer.BadParameter (exit 2) for what a calibrated method cannot do: a GGUF output or a
    --dtype that is no integer grid (llama.cpp's own quantizers choose GGUF codes), the error
    budget (it chooses specs, the method codes for a spec), a plan from headers (the method
    runs the model)."""
    if calibration is None:
        return
    name = calibration.method.value
    if fmt == FormatName.GGUF.value or not integer_grid:
        raise typer.BadParameter(
            f"{name} chooses integer codes for the qtool and compressed-tensors formats, not "
            "GGUF types; drop --method or choose --format qtool|compressed-tensors",
            param_hint="--method",
        )
    if target_sqnr is not None:
        raise typer.BadParameter(
            f"the error budget chooses a spec per tensor and {name} codes for one spec; "
            "drop one of them", param_hint="--method",
        )  # fmt: skip
    if dry_run and not estimate:
        raise typer.BadParameter(
            f"{name} runs the model, which a plain dry run does not; add --estimate "
            "(or drop --dry-run)", param_hint="--method",
        )  # fmt: skip
