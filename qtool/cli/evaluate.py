"""`qtool eval FLOAT QUANT`: both models on the same tokens; perplexity, KL and top-1 agreement
(causal LMs) or embedding cosine (encoders), per-layer output error, and gates on them. Parses,
calls qtool.api.evaluate, hands the result to the report (definitions in docs/eval.md)."""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from qtool.cli.app import app
from qtool.cli.errors import user_errors
from qtool.cli.help import DEBUG_ENV, GATES, INPUT, REPORT, RUN, Command, choices, epilog
from qtool.cli.inputs import EVAL_FLOAT, EVAL_QUANT
from qtool.cli.lazy import api, lazy_module, report
from qtool.cli.options import JsonOpt
from qtool.cli.quantize_options import MAX_THREADS, thread_count
from qtool.cli.render import GATE_FAILED, print_notes
from qtool.errors import UsageError
from qtool.eval_results import ENCODER, EvalBounds, arrange_layers, check
from qtool.spec import Device, EvalDtype

if TYPE_CHECKING:
    from qtool.report import eval_console as eval_report
    from qtool.report import eval_json
else:
    eval_report = lazy_module("qtool.report.eval_console")
    eval_json = lazy_module("qtool.report.eval_json")


class LayerOrder(str, Enum):
    OUTPUT = "output"
    WEIGHT = "weight"
    MODEL = "model"


def _finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number; give a finite bound")
    return value


def _at_least(least: int) -> Callable[[int | None], int | None]:
    """Typer's own `min=` would print `[x>=2]` in the help; the check is the same."""

    def check(value: int | None) -> int | None:
        if value is not None and value < least:
            raise typer.BadParameter(f"must be at least {least}, got {value}")
        return value

    return check


def _within(lo: float, hi: float) -> Callable[[float | None], float | None]:
    def check(value: float | None) -> float | None:
        value = _finite(value)
        if value is not None and not lo <= value <= hi:
            span = f"at least {lo:g}" if hi == math.inf else f"{lo:g} to {hi:g}"
            raise typer.BadParameter(f"{value:g} is out of range; give {span}")
        return value

    return check


def _bound(help_text: str, lo: float, hi: float = math.inf) -> Any:
    return typer.Option(
        help=help_text,
        callback=_within(lo, hi),
        metavar="X",
        show_default=False,
        rich_help_panel=GATES,
    )


FloatArg = Annotated[Path, typer.Argument(metavar="FLOAT", help=EVAL_FLOAT, show_default=False)]
QuantArg = Annotated[
    list[Path] | None,
    typer.Argument(
        metavar="QUANT...",
        help=f"{EVAL_QUANT} Several: each against one float pass.",
        show_default=False,
    ),
]
SaveLogitsOpt = Annotated[
    Path | None,
    typer.Option(
        help="Write FLOAT's side of the figures (every log-probability in 16 bits, with "
        "the text's, tokens' and model's digests) to FILE, for --logits.",
        metavar="FILE",
        show_default=False,
        rich_help_panel=INPUT,
    ),
]
SaveForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Replace an existing --save-logits FILE (eval writes nothing else).",
        rich_help_panel=INPUT,
    ),
]
LogitsOpt = Annotated[
    Path | None,
    typer.Option(
        help="FLOAT's side from a --save-logits FILE: FLOAT's weights are not read, but FLOAT "
        "is still given (its config, tokenizer and tensor headers, of which the file holds only "
        "digests, are what QUANT loads into); --text, --tokens, --ctx and --dtype default to "
        "the file's, and it is refused where they or the model differ from it.",
        metavar="FILE",
        show_default=False,
        rich_help_panel=INPUT,
    ),
]
TextOpt = Annotated[
    Path | None,
    typer.Option(
        help="UTF-8 text to evaluate on [default: CPython's pydoc_data topics; with --logits, "
        "the file's].",
        metavar="FILE",
        show_default=False,
        rich_help_panel=INPUT,
    ),
]
TokensOpt = Annotated[
    int | None,
    typer.Option(
        help="Tokens of the text to use (its first N, at least 2) [default: 4096; with "
        "--logits, the file's].",
        callback=_at_least(2),
        metavar="N",
        show_default=False,
        rich_help_panel=INPUT,
    ),
]
CtxOpt = Annotated[
    int | None,
    typer.Option(
        help="Window length in tokens (encoders: the longest sentence) [default: 512, or "
        "FLOAT's max_position_embeddings if smaller; with --logits, the file's].",
        callback=_at_least(2),
        metavar="N",
        show_default=False,
        rich_help_panel=INPUT,
    ),
]
EvalDtypeOpt = Annotated[
    EvalDtype | None,
    typer.Option(
        help="The dtype both models run in [default: float32; with --logits, the file's].",
        metavar=choices(EvalDtype),
        show_default=False,
        rich_help_panel=RUN,
    ),
]
EvalDeviceOpt = Annotated[
    Device,
    typer.Option(
        help="Where both models run; auto picks CUDA when available.",
        metavar=choices(Device),
        rich_help_panel=RUN,
    ),
]
EvalThreadsOpt = Annotated[
    int | None,
    typer.Option(
        help=f"CPU threads for the forward passes, 1 to {MAX_THREADS} [default: the idle cores].",
        callback=thread_count,
        metavar="N",
        show_default=False,
        rich_help_panel=RUN,
    ),
]
LayerTopOpt = Annotated[
    int | None,
    typer.Option(
        help="Per-layer rows: show only the first N (after --sort).",
        callback=_at_least(1),
        metavar="N",
        show_default=False,
        rich_help_panel=REPORT,
    ),
]
PerLayerOpt = Annotated[
    bool,
    typer.Option(
        "--per-layer",
        help="Add a row per quantized Linear: weight SQNR and output SQNR on FLOAT's inputs.",
        rich_help_panel=REPORT,
    ),
]
LayerSortOpt = Annotated[
    LayerOrder,
    typer.Option(
        "--sort",
        help="Per-layer rows: worst output or weight SQNR first, or model order.",
        metavar=choices(LayerOrder),
        rich_help_panel=REPORT,
    ),
]


@app.command(
    "eval",
    cls=Command,
    short_help="Run a float and a quantized model on the same text: perplexity, KL, top-1.",
    epilog=epilog(
        "qtool eval models/llama models/llama-w4a16 --max-kl 0.05 --per-layer", DEBUG_ENV
    ),
)
def eval_models(
    float_dir: FloatArg,
    quants: QuantArg = None,
    text: TextOpt = None,
    tokens: TokensOpt = None,
    ctx: CtxOpt = None,
    max_kl: Annotated[float | None, _bound("Fail above this mean KL, nats/token.", 0.0)] = None,
    max_ppl_ratio: Annotated[
        float | None, _bound("Fail above this perplexity ratio QUANT/FLOAT.", 0.0)
    ] = None,
    min_top1: Annotated[
        float | None, _bound("Fail below this top-1 agreement (0 to 1).", 0.0, 1.0)
    ] = None,
    min_cosine: Annotated[
        float | None, _bound("Encoders: fail below this mean cosine.", -1.0, 1.0)
    ] = None,
    per_layer: PerLayerOpt = False,
    order: LayerSortOpt = LayerOrder.OUTPUT,
    top: LayerTopOpt = None,
    as_json: JsonOpt = False,
    dtype: EvalDtypeOpt = None,
    device: EvalDeviceOpt = Device.AUTO,
    threads: EvalThreadsOpt = None,
    save_logits: SaveLogitsOpt = None,
    logits: LogitsOpt = None,
    force: SaveForceOpt = False,
) -> None:
    """Run FLOAT and QUANT on the same tokens, window by window, and compare their outputs:
    perplexity of each, KL(FLOAT || QUANT) per token, top-1 agreement (causal LMs), or the
    cosine of sentence embeddings (encoders). Several QUANTs are each compared with one float
    pass. Writes nothing but --save-logits."""
    bounds = EvalBounds(max_kl, max_ppl_ratio, min_top1, min_cosine)
    quants = quants or []
    with user_errors(as_json):
        _check_many(quants, per_layer, logits, save_logits)
        _check_bounds(bounds, api.eval_kind(float_dir))
        run_dtype = dtype.value if dtype is not None else None
        text_in, tokens_in, ctx_in, dtype_in = api.eval_inputs(logits, text, tokens, ctx, run_dtype)
        options = api.EvalOptions(
            text_in, tokens_in, ctx_in, dtype_in, device.value, per_layer, threads=threads
        )
        measured: list[Any] = []  # FLOAT's side: reported when no QUANT is
        with eval_report.eval_progress() as progress:
            summaries = api.evaluate_all(
                float_dir, quants, options, progress, logits, save_logits, force, measured.append
            )
    for summary in summaries:
        print_notes([f"{summary.inputs[1]}: {n}" if len(summaries) > 1 else n
                     for n in summary.notes])  # fmt: skip
    side = _float_side(logits, save_logits)
    if len(summaries) != 1:
        _print_many(summaries, bounds, as_json, side, measured[0] if measured else None)
        return
    summary = summaries[0]
    violations = check(bounds, summary)
    layers = None
    if summary.layers is not None:
        layers = arrange_layers(summary.layers, order.value, top)
    if as_json:
        report.print_json(eval_json.eval_json(summary, layers, bounds, violations, side))
    else:
        shown = violations if bounds.active else None
        eval_report.print_eval(summary, layers, shown, order.value, side)
    if violations:
        raise typer.Exit(GATE_FAILED)


def _check_many(
    quants: list[Path], per_layer: bool, logits: Path | None, save_logits: Path | None
) -> None:
    if not quants and logits is not None:  # `eval --logits FILE QUANT`: QUANT taken as FLOAT
        raise UsageError(
            None, "--logits FILE takes FLOAT then QUANT, one path given: the file holds only "
            "digests of FLOAT's config and tokenizer, which QUANT loads into; give both, FLOAT "
            "first (its weights are not read)",
        )  # fmt: skip
    if not quants and save_logits is None:
        raise UsageError(None, "give QUANT (one or more), or --save-logits FILE")
    if per_layer and (len(quants) > 1 or logits or save_logits):
        raise UsageError(
            None, "--per-layer compares one QUANT with FLOAT's own inputs: give one QUANT, "
            "without --logits or --save-logits",
        )  # fmt: skip
    if logits is not None and save_logits is not None:
        raise UsageError(
            None, "--logits reads the float side and --save-logits writes it: give one"
        )


def _float_side(logits: Path | None, save_logits: Path | None) -> Any:
    """The logits file FLOAT's side came from or went to (None: a float pass, nothing kept)."""
    if logits is not None:
        return eval_json.FloatSide(logits, read=True)
    if save_logits is not None:
        return eval_json.FloatSide(save_logits, read=False)
    return None


def _print_many(
    summaries: list[Any], bounds: EvalBounds, as_json: bool, side: Any, measured: Any
) -> None:
    """A row per QUANT (console) or a document per QUANT (JSON); exit 3 when any fails a gate.
    `measured`: FLOAT's side, shown alone when there is no QUANT."""
    results = [(s, check(bounds, s)) for s in summaries]
    if as_json:
        report.print_json(eval_json.many_json(results, bounds, side, measured))
    else:
        eval_report.print_many(results, bounds.active, side, measured)
    if any(v for _, v in results):
        raise typer.Exit(GATE_FAILED)


def _check_bounds(bounds: EvalBounds, kind: str) -> None:
    """A bound on a figure this kind of model has not is a usage error (exit 2)."""
    wrong = [f"--{name.replace('_', '-')}" for name in bounds.misplaced(kind)]
    if not wrong:
        return
    if kind == ENCODER:
        why = "bound(s) a causal LM's figures; FLOAT is an encoder: use --min-cosine"
    else:
        why = (
            "bounds an encoder's figure; FLOAT is a causal LM: use --max-kl, --max-ppl-ratio "
            "or --min-top1"
        )
    raise UsageError(None, f"{', '.join(wrong)} {why}")
