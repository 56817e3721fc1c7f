"""The options of `qtool quantize` alone, and the checks between them: a combination that
cannot work is a usage error (exit 2) before any file is read. Shared options (the spec, the
gates, the report) are in cli/options.py."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from qtool.cli.help import HOW, OUTPUT, RUN, SELECT, choices
from qtool.cli.inputs import QUANTIZE_INPUT
from qtool.cli.lazy import api, report
from qtool.codecs.gguf import GGUF_MIXES, gguf_choices, gguf_mix
from qtool.gguf_types import FLOAT_TYPES
from qtool.spec import (
    GGUF_QUANTIZE_TYPES,
    Codec,
    Device,
    GroupFallback,
    ImatrixUse,
    RangeMethod,
    Scheme,
    SpecPatch,
    StorageDtype,
    gguf_float_spec,
    gguf_quantize_spec,
    is_gguf_name,
)

MAX_THREADS = 1024  # torch's thread pools crash (SIGSEGV) when asked for ~100,000 threads


def thread_count(value: int | None) -> int | None:
    if value is not None and not 1 <= value <= MAX_THREADS:
        raise typer.BadParameter(f"must be 1 to {MAX_THREADS}")
    return value


_INT_DTYPES = tuple(d.value for d in StorageDtype)


def dtype_value(value: str) -> str:
    """--dtype: an integer code type (int8, ...) or a GGUF block type (Q4_K, any case)."""
    if value.lower() in _INT_DTYPES:
        return value.lower()
    if value.upper() in GGUF_MIXES or value.upper() in FLOAT_TYPES:  # Q4_K_M; F16 (converted)
        return value.upper()
    try:
        spec = gguf_quantize_spec(value)
    except ValueError as err:
        if is_gguf_name(value):  # a GGUF type qtool does not write (IQ2_XXS)
            raise typer.BadParameter(str(err)) from None
        raise typer.BadParameter(
            f"'{value}' is not one of {', '.join(_INT_DTYPES)} nor a GGUF type ({gguf_choices()})"
        ) from None
    return spec.label()


QuantizeDtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        help=f"Integer type of the codes: {', '.join(_INT_DTYPES)} (4-bit packed two per "
        f"byte); with --format gguf, a GGUF block type, {', '.join(GGUF_QUANTIZE_TYPES)} (they "
        "fix their own layout), one of llama.cpp's mixes (Q4_K_M ...), or F16, BF16, F32 (a "
        "Hugging Face directory converted, nothing quantized).",
        metavar="TYPE",  # the choices are in the help, which wraps: 14 of them ran past 80 columns
        callback=dtype_value,
        rich_help_panel=HOW,
    ),
]


def gguf_cli_spec(
    dtype: str,
    scheme: Scheme,
    per_channel: bool,
    axis: int | None,
    group_size: int | None,
    range_method: RangeMethod,
    ctx: typer.Context,
) -> Codec:
    """--dtype Q4_K: the GGUF type's spec; typer.BadParameter naming an option that would set
    what the block type fixes itself (for F16, any option `ctx` was given but a conversion's)."""
    given = {
        "--scheme": scheme is not Scheme.SYM,
        "--per-tensor": not per_channel,
        "--axis": axis not in (None, 0),
        "--group-size": group_size is not None,
        "--range": range_method is not RangeMethod.MINMAX,
    }
    for flag, set_ in given.items():
        if set_:
            raise typer.BadParameter(
                f"{dtype} is {_what(dtype)}; drop {flag}",
                param_hint=flag,
            )
    if dtype in FLOAT_TYPES:
        _only_conversion_options(dtype, ctx)
        return gguf_float_spec(dtype)
    return gguf_mix(dtype) if dtype in GGUF_MIXES else gguf_quantize_spec(dtype)


_CONVERSION_OPTIONS = {"src", "out", "dtype", "fmt", "dry_run", "estimate", "threads", "as_json",
                       "force", "sort", "top", "show_all"}  # fmt: skip
"""What a float GGUF's conversion takes: the rest chooses or checks codes it does not make
(--device too: a cast computes on no device, and `--device cuda` would pass unchecked)."""


def _only_conversion_options(dtype: str, ctx: typer.Context) -> None:
    """--dtype F16 converts a model directory and quantizes nothing: an option given that
    selects, types, calibrates, gates tensors or picks a device is a usage error naming it."""
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name) if param.name else None
        if param.name in _CONVERSION_OPTIONS or source is None or source.name == "DEFAULT":
            continue
        flag = param.opts[0] if param.opts else str(param.name)
        raise typer.BadParameter(
            f"does not apply to --dtype {dtype}, which writes a float GGUF (a Hugging Face "
            "directory converted, no tensor quantized); drop it",
            param_hint=flag,
        )


def _what(dtype: str) -> str:
    if dtype in FLOAT_TYPES:
        return "a float GGUF type, which quantizes nothing"
    return "a GGUF block type, which fixes its own scales and groups"


InputArg = Annotated[Path, typer.Argument(metavar="INPUT", help=QUANTIZE_INPUT, show_default=False)]
QuantizeOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        help="Output .safetensors file, or an existing directory to put the default name in "
        "(for sharded input, and for --format compressed-tensors: the output directory) "
        "[default: INPUT-STEM.DTYPE.safetensors beside the input; DTYPE reads `quantized` "
        "when the tensors' dtypes may differ].",
        metavar="PATH",
        show_default=False,
        rich_help_panel=OUTPUT,
    ),
]
IncludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--include",
        help="Glob of tensor names to quantize (repeatable); also selects 1-D tensors.",
        metavar="GLOB",
        show_default=False,
        rich_help_panel=SELECT,
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
        rich_help_panel=SELECT,
    ),
]
RecipeOpt = Annotated[
    Path | None,
    typer.Option(
        "--recipe",
        help="TOML file of per-tensor rules: a spec or keep-in-float per name pattern.",
        metavar="FILE",
        show_default=False,
        rich_help_panel=SELECT,
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
        rich_help_panel=SELECT,
    ),
]
TargetSizeOpt = Annotated[
    str | None,
    typer.Option(
        "--target-size",
        help="Allocation: the spec per tensor of least predicted loss whose output (tensor "
        "payload, scales included) fits SIZE (100MiB, 0.1GB, bytes); with --imatrix weighed "
        "by it and its sensitivities.",
        metavar="SIZE",
        show_default=False,
        rich_help_panel=SELECT,
    ),
]
TargetBpwOpt = Annotated[
    float | None,
    typer.Option(
        "--target-bpw",
        help="Allocation as --target-size, the size given in bits per weight of the model.",
        metavar="N",
        show_default=False,
        rich_help_panel=SELECT,
    ),
]
TargetKlOpt = Annotated[
    float | None,
    typer.Option(
        "--target-kl",
        help="Allocation: the smallest output whose KL (nats/token) is <= X, measured on "
        "held-out windows of calibrate's default text (solved again while over); needs an "
        "--imatrix with sensitivities (qtool calibrate --sensitivity).",
        metavar="X",
        show_default=False,
        rich_help_panel=SELECT,
    ),
]
SaveRecipeOpt = Annotated[
    Path | None,
    typer.Option(
        "--save-recipe",
        help="Write the allocation's plan as a recipe: --recipe FILE reproduces it.",
        metavar="FILE",
        show_default=False,
        rich_help_panel=OUTPUT,
    ),
]
TensorTypeFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--tensor-type-file",
        help="Write the allocation's plan (--format gguf) as llama-quantize's --tensor-type-file.",
        metavar="FILE",
        show_default=False,
        rich_help_panel=OUTPUT,
    ),
]
ImatrixOpt = Annotated[
    Path | None,
    typer.Option(
        "--imatrix",
        help="Importance matrix (llama-imatrix's GGUF or .dat, or qtool calibrate's): "
        "--range mse minimises the error weighted by each input column's mean square, and "
        "the table adds the weighted SQNR.",
        metavar="FILE",
        show_default=False,
        rich_help_panel=HOW,
    ),
]


ImatrixUseOpt = Annotated[
    ImatrixUse,
    typer.Option(
        "--imatrix-use",
        help="all: --imatrix weighs the codes' search and, with an allocation target, the "
        "plan; plan: it chooses each tensor's spec only (its statistics and sensitivities), "
        "the codes are those of a run without it, as its --save-recipe reproduces alone.",
        metavar="all|plan",
        rich_help_panel=HOW,
    ),
]
KeepNonfiniteOpt = Annotated[
    bool,
    typer.Option(
        "--keep-nonfinite",
        help="Keep tensors holding NaN/Inf unquantized instead of failing.",
        rich_help_panel=SELECT,
    ),
]
_FORMATS = api.output_formats()  # the registry's writable formats, with their help lines
if TYPE_CHECKING:
    FormatChoice = str
else:
    FormatChoice = Literal[tuple(name for name, _ in _FORMATS)]
FormatOpt = Annotated[
    FormatChoice,
    typer.Option(
        "--format",
        help=" ".join(f"{name}: {line}" for name, line in _FORMATS),
        metavar="|".join(name for name, _ in _FORMATS),
        rich_help_panel=OUTPUT,
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
        rich_help_panel=OUTPUT,
    ),
]
GroupFallbackOpt = Annotated[
    GroupFallback,
    typer.Option(
        "--group-fallback",
        help="compressed-tensors, when --group-size does not divide a tensor's row length: "
        "error (name them), channel (those per channel) or keep (those in float).",
        metavar=choices(GroupFallback),
        rich_help_panel=OUTPUT,
    ),
]
AllowRequantizeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-requantize",
        help="With --format gguf: quantize an already quantized GGUF again (dequantized to "
        "F32 in a scratch directory beside the output first; quality is lost twice).",
        rich_help_panel=OUTPUT,
    ),
]
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Print what would be done (from headers only) and write nothing.",
        rich_help_panel=OUTPUT,
    ),
]
EstimateOpt = Annotated[
    bool,
    typer.Option(
        "--estimate",
        help="With --dry-run: also compute the error figures (reads the data, writes nothing).",
        rich_help_panel=OUTPUT,
    ),
]
DeviceOpt = Annotated[
    Device,
    typer.Option(
        help="Where the kernels run; auto picks CUDA when available.",
        metavar=choices(Device),
        rich_help_panel=RUN,
    ),
]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        help=f"CPU threads for the kernels, 1 to {MAX_THREADS} [default: the idle cores].",
        callback=thread_count,
        metavar="N",
        show_default=False,
        rich_help_panel=RUN,
    ),
]


def quantize_mode(dry_run: bool, estimate: bool, measured: str | None, budget: bool) -> str:
    """The run --dry-run and --estimate ask for (plan, estimate or write; qtool.api.Mode);
    typer.BadParameter (exit 2) for one that cannot give what the other options need.
    `measured`: the first option given that needs error figures (a gate, --plot), or None."""
    if estimate and not dry_run:
        raise typer.BadParameter("goes only with --dry-run", param_hint="--estimate")
    if dry_run and not estimate and measured is not None:
        raise typer.BadParameter(
            f"{measured} needs error figures, which a plain dry run does not compute; "
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


def check_format_options(fmt: str, config: Path | None, fallback: GroupFallback) -> None:
    """--config and --group-fallback mean something only to a format that reads a model's
    config (compressed-tensors; the registry says which): the option given is the one blamed."""
    refused = api.format_option_refusal(
        fmt, config=config is not None, group_fallback=fallback is not GroupFallback.ERROR
    )
    if refused is not None:
        raise typer.BadParameter(refused.message, param_hint=f"--{refused.hint}")


def check_format_spec(fmt: str, spec: Codec, budget: bool) -> None:
    """A spec the output format can store for no tensor at all (compressed-tensors: unsigned
    codes, another axis) is a usage error naming the option to change; not with the error
    budget (`budget`), whose ladder chooses the specs instead."""
    refused = None if budget and not spec.whole else api.format_refuses(fmt, spec)
    if refused is None:
        return
    message = refused.message
    if fmt == "gguf" and refused.hint == "dtype":  # the format lists the types it quantizes to
        message += "; or F16, BF16 or F32: a Hugging Face directory converted, nothing quantized"
    if refused.hint == "dtype" and _defaulted("dtype"):  # the user gave no --dtype to blame
        message = (f"give --dtype (the default, {spec.describe()}, is not a type --format {fmt} "
                   "stores; a recipe's rules type their own tensors, --dtype all others): "
                   f"{message}")  # fmt: skip
    raise typer.BadParameter(message, param_hint=f"--{refused.hint}")


def _defaulted(param: str) -> bool:
    """Whether the running command's `param` took its default (not given by the user)."""
    from typer._click.globals import get_current_context

    ctx = get_current_context(silent=True)
    source = ctx.get_parameter_source(param) if ctx is not None else None
    return source is not None and source.name == "DEFAULT"


def check_imatrix(
    imatrix: Path | None, budget: bool, method: bool, *, gguf: bool, minmax: bool, recipe: bool
) -> None:
    """--imatrix weighs the range search and ggml's quantizers: refused with the error budget,
    whose trials it does not weigh yet, with a calibrated --method, whose codes come from its
    own statistics (the imatrix would weigh nothing but the figures), and with min-max ranges
    outside GGUF (`minmax`, no recipe to set another range): the codes would not change, yet
    the output would record the imatrix as used."""
    if imatrix is None:
        return
    if budget:
        why = "the error budget (--target-sqnr) does not weigh its trials by one yet"
    elif method:
        why = "a calibrated --method chooses its codes from its own statistics; give one of them"
    elif minmax and not gguf and not recipe:
        why = "weighs the range search: add --range mse"
    else:
        return
    raise typer.BadParameter(why, param_hint="--imatrix")


_SPEC_FLAGS = {
    "scheme": "--scheme",
    "dtype": "--dtype",
    "per_channel": "--per-channel/--per-tensor",
    "axis": "--axis",
    "group_size": "--group-size",
    "range_method": "--range",
}
_PATCH_FIELD = {"scheme": "scheme", "dtype": "dtype", "range_method": "range_method"}


def warn_budget_overrides(ctx: typer.Context, options: api.QuantizeOptions, target: str) -> None:
    """One stderr line naming the spec options given with `target` (--target-sqnr or an
    allocation target), whose ladder overrides them (an option still applies where a recipe
    rule leaves its field open)."""
    sources = {p: ctx.get_parameter_source(p) for p in _SPEC_FLAGS}
    given = [p for p, source in sources.items() if source and source.name == "COMMANDLINE"]
    recipe = options.recipe.rules if options.recipe is not None else ()
    patches = [r.action for r in recipe if isinstance(r.action, SpecPatch)]
    ignored = [
        _SPEC_FLAGS[p]
        for p in given
        if not any(getattr(patch, _PATCH_FIELD.get(p, "granularity")) is None for patch in patches)
    ]
    if ignored:
        report.print_warning(
            f"{', '.join(ignored)} ignored: {target} picks each tensor's spec from its "
            "ladder (docs/recipes.md)"
        )


_SIZE_UNITS = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """'100MiB' -> 104857600, '0.1GB' -> 100000000, '5000' -> 5000 (bytes, rounded down);
    typer.BadParameter for anything else or a size under one byte."""
    import re

    m = re.fullmatch(
        r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e([+-]?[0-9]{1,2}))?\s*([a-zA-Z]*)\s*", text
    )
    unit = m.group(3).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise typer.BadParameter(
            f"{text!r} is no size: give a number with B, KB, MB, GB, KiB, MiB or GiB "
            "(100MiB, 0.1GB)", param_hint="--target-size",
        )  # fmt: skip
    from decimal import Decimal

    value = Decimal(m.group(1)) * Decimal(10) ** int(m.group(2) or 0) * _SIZE_UNITS[unit]
    if value < 1 or value > 2**62:
        raise typer.BadParameter(f"{text!r} is out of range", param_hint="--target-size")
    return int(value)


def allocation_target(
    size: str | None, bpw: float | None, kl: float | None, target_sqnr: float | None
) -> api.AllocationTarget | None:
    """The one target given among --target-size/--target-bpw/--target-kl (None: none);
    typer.BadParameter for two targets (--target-sqnr included) or a value <= 0."""
    given = [
        (flag, value)
        for flag, value in (
            ("--target-sqnr", target_sqnr), ("--target-size", size), ("--target-bpw", bpw),
            ("--target-kl", kl),
        )
        if value is not None
    ]  # fmt: skip
    if len(given) > 1:
        flags = " and ".join(flag for flag, _ in given)
        each = "both" if len(given) == 2 else "all"
        raise typer.BadParameter(f"give one target: {flags} {each} given", param_hint=given[1][0])
    if size is not None:
        return api.AllocationTarget("size", parse_size(size))
    for kind, value in (("bpw", bpw), ("kl", kl)):
        if value is None:
            continue
        if not (value > 0 and value < float("inf")):
            raise typer.BadParameter(
                f"must be a finite number above 0, not {value}", param_hint=f"--target-{kind}"
            )
        if kind == "bpw" and value > (most := api.AllocationTarget.MAX_BPW):
            raise typer.BadParameter(
                f"is at most {most:g} (float64 kept: no plan stores more), not {value:g}",
                param_hint="--target-bpw",
            )
        return api.AllocationTarget(kind, value)
    return None


def check_imatrix_use(
    use: ImatrixUse, imatrix: Path | None, target: api.AllocationTarget | None
) -> None:
    """--imatrix-use plan needs what it plans with (an --imatrix) and a plan to make."""
    if use is ImatrixUse.ALL:
        return
    if imatrix is None:
        raise typer.BadParameter("plans with an importance matrix: add --imatrix FILE",
                                 param_hint="--imatrix-use")  # fmt: skip
    if target is None:
        raise typer.BadParameter(
            "guides an allocation: give --target-size, --target-bpw or --target-kl (or drop "
            "--imatrix-use plan: without a plan the imatrix would weigh nothing)",
            param_hint="--imatrix-use",
        )


def check_plan_files(
    target: api.AllocationTarget | None,
    save_recipe: Path | None,
    tensor_types: Path | None,
    gguf: bool,
    dry_run: bool,
    estimate: bool,
) -> None:
    """--save-recipe/--tensor-type-file need an allocation target (the latter a GGUF output);
    an allocation measures each tensor, which a plain dry run does not."""
    for flag, path in (("--save-recipe", save_recipe), ("--tensor-type-file", tensor_types)):
        if path is not None and target is None:
            raise typer.BadParameter(
                "writes an allocation's plan: give --target-size, --target-bpw or --target-kl",
                param_hint=flag,
            )
    if tensor_types is not None and not gguf:
        raise typer.BadParameter("is llama-quantize's: add --format gguf",
                                 param_hint="--tensor-type-file")  # fmt: skip
    if target is not None and dry_run and not estimate:
        raise typer.BadParameter(
            "the allocation measures each tensor, which a plain dry run does not; add "
            "--estimate (or drop --dry-run)", param_hint=f"--target-{target.kind}",
        )  # fmt: skip
