"""What happens to each tensor, decided from headers alone (torch-free, so dry runs are instant).

Default: floating-point tensors with 2 or more dimensions are quantized; 1-D tensors (biases,
norms), 0-d scalars, empty tensors and every non-float tensor pass through byte for byte.
`include` globs widen the selection (a matched 0-d/1-D float tensor is quantized per tensor),
`exclude` globs narrow it, and exclude wins.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, replace
from pathlib import Path

from qtool.dtypes import DTYPE_BITS
from qtool.errors import InputError
from qtool.formats.detect import refuse_quantized
from qtool.formats.qtool import sidecar_path
from qtool.io.atomic import refuse_file_name_for_directory, resolve_output
from qtool.io.index import default_output_dir, is_sharded, load_index
from qtool.io.stformat import HeaderError, TensorEntry, read_header
from qtool.recipe.rules import Keep, Recipe, Rule, RuleKind, resolve, rules_from_cli
from qtool.results import ErrorStats, QuantizeSummary, TensorRow
from qtool.spec import (
    INT8_CHANNEL,
    FormatName,
    GroupFallback,
    PerGroup,
    QSpec,
    RangeMethod,
    packed_shape,
    qparam_shape,
)
from qtool.spec import fit_spec as fit_to_shape


@dataclass(frozen=True)
class QuantizeOptions:
    spec: QSpec = QSpec()
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    keep_nonfinite: bool = False  # keep NaN/Inf tensors unquantized instead of failing
    recipe: Recipe | None = None  # per-tensor rules, tried after --exclude, before --include
    target_sqnr: float | None = None  # error budget for the tensors no recipe rule fixed
    format: FormatName = FormatName.QTOOL  # the output format
    config: Path | None = None  # the model's config.json, for a single-file model export
    group_fallback: GroupFallback = GroupFallback.ERROR  # K not a multiple of G

    def __post_init__(self) -> None:
        # the names as plain strings too ("compressed-tensors"), as a library caller writes them
        object.__setattr__(self, "format", FormatName(self.format))
        object.__setattr__(self, "group_fallback", GroupFallback(self.group_fallback))

    @property
    def rules(self) -> tuple[Rule, ...]:
        """Every rule in the order tried: --exclude, the recipe's, --include."""
        recipe_rules = self.recipe.rules if self.recipe is not None else ()
        return rules_from_cli(self.include, self.exclude, recipe_rules)


@dataclass(frozen=True)
class TensorPlan:
    """One tensor's fate: `spec` is None when it is kept as is, with `reason` saying why;
    `note` says how the spec was adapted to this tensor (e.g. a group as long as a row)."""

    entry: TensorEntry
    spec: QSpec | None
    reason: str = ""
    note: str = ""
    rule: str = ""  # with a recipe: the rule that decided ("rule 3 'mlp.*'"), shown in tables
    rule_origin: str = ""  # where a recipe rule is written ("llm.toml: line 12: ")
    budget: bool = False  # the error budget (--target-sqnr) decides this tensor's spec
    by_rule: bool = False  # a rule decided by name (recipe.Resolution.by_rule)
    own_spec: bool = False  # a recipe rule or the budget chose the spec, not the command line
    asked: QSpec | None = None  # the spec before it was fitted to the tensor (a format may refuse)
    stored_nbytes: int | None = None  # bytes in the output, when the format says (else qtool's)
    stored_dtype: str | None = None  # the codes' dtype, when the format says (else qtool's)

    @property
    def out_dtype(self) -> str:
        if self.stored_dtype is not None:
            return self.stored_dtype
        return self.spec.dtype.safetensors_dtype if self.spec else self.entry.dtype

    @property
    def out_shape(self) -> tuple[int, ...]:
        """Shape as stored: 4-bit codes are packed two per byte along the last dimension."""
        if self.spec is not None and self.spec.dtype.packed:
            return packed_shape(self.entry.shape)
        return self.entry.shape

    @property
    def qparam_nbytes(self) -> int:
        """Bytes this tensor adds to the sidecar: a float32 scale and a 1-byte zero point per
        group, and with --range mse the 1-byte index of the range each group kept (0 when the
        format counts its qparams in `stored_nbytes`)."""
        if self.spec is None or self.stored_nbytes is not None:
            return 0
        per_group = 6 if self.spec.range_method is RangeMethod.MSE else 5
        return math.prod(qparam_shape(self.spec.granularity, self.entry.shape)) * per_group

    @property
    def out_nbytes(self) -> int:
        """Bytes of the tensor in the output file: its codes, or the tensor as it is."""
        if self.stored_nbytes is not None:
            return self.stored_nbytes
        return math.prod(self.out_shape) * DTYPE_BITS[self.out_dtype] // 8

    def kept(self, reason: str) -> TensorPlan:
        """The tensor stored as it is (its size and dtype in any format: its own)."""
        return replace(self, spec=None, reason=reason, stored_nbytes=None, stored_dtype=None)


def plan_tensors(
    path: Path, entries: tuple[TensorEntry, ...], options: QuantizeOptions
) -> list[TensorPlan]:
    """A plan for every entry, in file order; InputError for an axis a tensor lacks."""
    return [_plan_one(path, e, options) for e in entries]


def _plan_one(path: Path, entry: TensorEntry, options: QuantizeOptions) -> TensorPlan:
    """The first matching rule decides (recipe.resolve); without a recipe, exactly the
    --include/--exclude selection."""
    found = resolve(options.rules, entry, options.spec, checkpoint=path)
    rule = found.rule.describe() if options.recipe is not None and found.rule else ""
    if isinstance(found.action, Keep):
        return TensorPlan(entry, None, found.action.reason, rule=rule, by_rule=found.by_rule)
    if options.target_sqnr is not None and found.from_command_line:
        # the budget decides: the command-line spec does not apply, nor may a format check it
        spec, _ = fit_to_shape(INT8_CHANNEL, entry.shape)
        return TensorPlan(entry, spec, rule=rule, budget=True, by_rule=found.by_rule, own_spec=True)
    return TensorPlan(
        entry,
        found.action,
        note=found.note,
        rule=rule,
        rule_origin=_origin(found.rule),
        by_rule=found.by_rule,
        asked=found.asked,
        own_spec=not found.from_command_line,
    )


def _origin(rule: Rule | None) -> str:
    """Where a recipe rule is written, for messages ("" for a command-line rule)."""
    if rule is None or rule.kind is not RuleKind.RECIPE:
        return ""
    return f"{rule.file}: line {rule.line}: "


def fit_spec(path: Path, entry: TensorEntry, spec: QSpec) -> QSpec:
    """The spec as it applies to this tensor (recipe.fit_spec); InputError naming `path` and
    the tensor for a channel axis it lacks."""
    try:
        return fit_to_shape(spec, entry.shape)[0]
    except ValueError as err:
        raise InputError(
            path, f"{err} or exclude the tensor", entry.name, hint=("axis", "exclude")
        ) from None


def unmatched_globs(names: list[str], patterns: tuple[str, ...]) -> list[str]:
    """The patterns that match none of `names` (a typo, or a glob for another model)."""
    return [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]


def default_quantized_path(src: Path, dtype: str) -> Path:
    """`model.safetensors` -> `model.int8.safetensors` beside it."""
    return src.with_name(f"{src.stem}.{dtype}.safetensors")


def quantized_output(src: Path, out: Path | None, dtype: str) -> Path:
    """The quantized file `-o` names: a .safetensors file, or the default name in a directory."""
    return resolve_output(out, default_quantized_path(src, dtype), (".safetensors",), "quantize")


def planned_row(
    plan: TensorPlan,
    errors: ErrorStats | None = None,
    scale_range: tuple[float, float] | None = None,
) -> TensorRow:
    """The table row of a plan, with the error figures and scale range once measured."""
    e = plan.entry
    detail = plan.spec.describe() if plan.spec else f"kept: {plan.reason}"
    if plan.budget and plan.spec is None:
        detail = plan.reason  # "kept float: best 22.3 dB < 24"
    if plan.spec is not None and isinstance(plan.spec.granularity, PerGroup):
        c, n = qparam_shape(plan.spec.granularity, e.shape)
        detail = f"{detail} ({c}x{n} groups)"
    if plan.note:
        detail = f"{detail} ({plan.note})"
    if plan.rule and plan.rule not in detail:  # "excluded by --exclude 'x'" names it already
        detail = f"{detail} [{plan.rule}]"
    return TensorRow(
        e.name,
        e.shape,
        e.dtype,
        plan.out_dtype,
        plan.spec is not None,
        detail,
        e.nbytes,
        plan.out_nbytes,
        bytes_qparams=plan.qparam_nbytes,
        errors=errors,
        scale_range=scale_range,
        spec=plan.spec,
        spec_chosen=plan.own_spec and plan.spec is not None,
    )


def dry_run(src: Path, out: Path | None, options: QuantizeOptions) -> QuantizeSummary | None:
    """The plan of a safetensors or sharded input from its headers alone (no torch import);
    None for a torch pickle, which has to be loaded to be planned, with an error budget,
    whose choices need the data, and for another output format than qtool's (the run plans
    those)."""
    if options.target_sqnr is not None or options.format != "qtool":
        return None
    if is_sharded(src):
        sharded = load_index(src)
        refuse_file_name_for_directory(out, "quantize")
        directory = out or default_output_dir(sharded.index, options.spec.dtype.value)
        rows = []
        for shard in sharded.shards:
            path = sharded.directory / shard
            header = read_header(path)
            refuse_quantized(path, header.metadata, [t.name for t in header.tensors])
            rows += [planned_row(p) for p in plan_tensors(path, header.tensors, options)]
        return _dry_summary([sharded.index], [directory], rows, options)
    out = quantized_output(src, out, options.spec.dtype.value)
    if not src.is_file():
        return None
    try:
        header = read_header(src)
    except HeaderError:
        return None  # a pickle, or a broken file: the full path reports it properly
    refuse_quantized(src, header.metadata, [t.name for t in header.tensors])
    rows = [planned_row(p) for p in plan_tensors(src, header.tensors, options)]
    return _dry_summary([src], [out, sidecar_path(out)], rows, options)


def _dry_summary(
    inputs: list[Path], outputs: list[Path], rows: list[TensorRow], options: QuantizeOptions
) -> QuantizeSummary:
    return QuantizeSummary(
        inputs=[str(p) for p in inputs],
        outputs=[str(p) for p in outputs],
        rows=rows,
        spec=options.spec,
        device="none",
        dry_run=True,
    )
