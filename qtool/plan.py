"""What happens to each tensor, decided from headers alone (torch-free, so dry runs are instant).

Default: floating-point tensors with 2 or more dimensions are quantized; 1-D tensors (biases,
norms), 0-d scalars, empty tensors and every non-float tensor pass through byte for byte.
`include` globs widen the selection (a matched 0-d/1-D float tensor is quantized per tensor),
`exclude` globs narrow it, and exclude wins.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace
from pathlib import Path

from qtool.detect import refuse_quantized
from qtool.errors import InputError
from qtool.index import default_output_dir, is_sharded, load_index
from qtool.sidecar import sidecar_path
from qtool.spec import QSpec
from qtool.stformat import DTYPE_BITS, FLOAT_DTYPES, HeaderError, TensorEntry, read_header
from qtool.summary import QuantizeSummary, TensorRow


@dataclass(frozen=True)
class QuantizeOptions:
    spec: QSpec = QSpec()
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    keep_nonfinite: bool = False  # keep NaN/Inf tensors unquantized instead of failing


@dataclass(frozen=True)
class TensorPlan:
    """One tensor's fate: `spec` is None when it is kept as is, with `reason` saying why."""

    entry: TensorEntry
    spec: QSpec | None
    reason: str = ""

    @property
    def out_dtype(self) -> str:
        return self.spec.dtype.safetensors_dtype if self.spec else self.entry.dtype

    @property
    def out_nbytes(self) -> int:
        return self.entry.numel * DTYPE_BITS[self.out_dtype] // 8

    def kept(self, reason: str) -> TensorPlan:
        return replace(self, spec=None, reason=reason)


def plan_tensors(
    path: Path, entries: tuple[TensorEntry, ...], options: QuantizeOptions
) -> list[TensorPlan]:
    """A plan for every entry, in file order; InputError for an axis a tensor lacks."""
    return [_plan_one(path, e, options) for e in entries]


def _plan_one(path: Path, entry: TensorEntry, options: QuantizeOptions) -> TensorPlan:
    plan = TensorPlan(entry, None)
    excluded = _first_match(entry.name, options.exclude)
    included = _first_match(entry.name, options.include)
    if excluded is not None:
        return plan.kept(f"excluded by --exclude '{excluded}'")
    if options.include and included is None:
        return plan.kept("not matched by --include")
    if entry.dtype not in FLOAT_DTYPES:
        return plan.kept(_non_float_reason(entry.dtype))
    if entry.numel == 0:
        return plan.kept("empty tensor")
    ndim = len(entry.shape)
    if ndim < 2 and included is None:
        return plan.kept("0-d scalar" if ndim == 0 else "1-D (bias/norm)")
    spec = options.spec
    if spec.axis is not None and ndim < 2:
        spec = replace(spec, axis=None)  # a 0-d/1-D tensor named by --include: per tensor
    elif spec.axis is not None:
        if not -ndim <= spec.axis < ndim:
            raise InputError(
                path,
                f"--axis {spec.axis} is out of range for this {ndim}-D tensor; "
                f"choose an axis in [{-ndim}, {ndim - 1}] or --exclude it",
                entry.name,
            )
        spec = replace(spec, axis=spec.axis % ndim)
    return TensorPlan(entry, spec)


def _first_match(name: str, patterns: tuple[str, ...]) -> str | None:
    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def _non_float_reason(dtype: str) -> str:
    if dtype == "BOOL":
        return "bool tensor"
    if dtype.startswith(("I", "U")):
        return "integer tensor"
    if dtype.startswith("F8") or dtype.startswith(("F4", "F6")):
        return f"already low-precision ({dtype})"
    return f"not a real float tensor ({dtype})"


def default_quantized_path(src: Path, dtype: str) -> Path:
    """`model.safetensors` -> `model.int8.safetensors` beside it."""
    return src.with_name(f"{src.stem}.{dtype}.safetensors")


def planned_row(plan: TensorPlan) -> TensorRow:
    e = plan.entry
    detail = plan.spec.describe() if plan.spec else f"kept: {plan.reason}"
    return TensorRow(
        e.name,
        e.shape,
        e.dtype,
        plan.out_dtype,
        plan.spec is not None,
        detail,
        e.nbytes,
        plan.out_nbytes,
    )


def dry_run(src: Path, out: Path | None, options: QuantizeOptions) -> QuantizeSummary | None:
    """The plan of a safetensors or sharded input from its headers alone (no torch import);
    None for a torch pickle, which has to be loaded to be planned."""
    if is_sharded(src):
        sharded = load_index(src)
        directory = out or default_output_dir(sharded.index, options.spec.dtype.value)
        rows = []
        for shard in sharded.shards:
            path = sharded.directory / shard
            header = read_header(path)
            refuse_quantized(path, header.metadata, [t.name for t in header.tensors])
            rows += [planned_row(p) for p in plan_tensors(path, header.tensors, options)]
        return _dry_summary([sharded.index], [directory], rows, options)
    if not src.is_file():
        return None
    try:
        header = read_header(src)
    except HeaderError:
        return None  # a pickle, or a broken file: the full path reports it properly
    refuse_quantized(src, header.metadata, [t.name for t in header.tensors])
    out = out or default_quantized_path(src, options.spec.dtype.value)
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
