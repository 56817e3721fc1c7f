"""Result value objects the engine returns and the report renders (torch-free)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Protocol

from qtool.calibration import TextUse
from qtool.spec import Codec, FormatName


class Progress(Protocol):
    """Receives the input bytes to process, then each tensor's name as it starts (0 bytes) and
    its bytes as they are done (a large tensor's slab by slab)."""

    def start(self, total_bytes: int) -> None: ...

    def advance(self, name: str, nbytes: int) -> None: ...


@dataclass(frozen=True)
class ErrorStats:
    """Error of a reconstruction, kept as sums so that tensors combine exactly."""

    numel: int
    sq_error: float  # sum (x - x_hat)^2
    sq_signal: float  # sum x^2
    max_abs: float
    sq_error_minmax: float | None = None  # --range mse: the squared error min-max would give

    @property
    def mse(self) -> float:
        return self.sq_error / self.numel if self.numel else 0.0

    @property
    def sqnr_db(self) -> float:
        """10 log10(sum x^2 / sum (x - x_hat)^2); +inf for an exact reconstruction."""
        return sqnr_db(self.sq_signal, self.sq_error)

    @property
    def mse_gain(self) -> float | None:
        """What the mse range search bought: the relative change of the squared error against
        min-max (-0.082: 8.2 % less); None when min-max was used."""
        if self.sq_error_minmax is None or self.sq_error_minmax == 0.0:
            return None
        return self.sq_error / self.sq_error_minmax - 1.0

    @property
    def finite(self) -> bool:
        """False when an input held NaN/Inf: such figures mean nothing and fail every gate."""
        return all(math.isfinite(v) for v in (self.sq_error, self.sq_signal, self.max_abs))


@dataclass(frozen=True)
class WeightedError:
    """A tensor's error weighted by an importance matrix (docs/numerics.md): sums of
    h_j w_ij^2 and h_j (w_ij - w^_ij)^2 over its values, so that tensors pool exactly."""

    sq_signal: float
    sq_error: float

    @property
    def sqnr_db(self) -> float:
        """The weighted SQNR: an estimate of the output SQNR with uncorrelated inputs; NaN
        (undefined, never exact) where the weights give the values no energy at all."""
        return math.nan if self.sq_signal == 0.0 else sqnr_db(self.sq_signal, self.sq_error)


def sqnr_db(sq_signal: float, sq_error: float) -> float:
    """+inf: exact; -inf: all error, no signal (x is all zeros and x_hat is not)."""
    if math.isnan(sq_signal) or math.isnan(sq_error):
        return math.nan
    if sq_error == 0.0:
        return math.inf
    ratio = sq_signal / sq_error
    if ratio == 0.0:  # no signal at all, or so little that the ratio underflows
        return -math.inf
    return 10.0 * math.log10(ratio)


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key in reading order: `layers.2` before `layers.10` (digit runs compare as numbers)."""
    parts = re.split(r"(\d+)", name)
    return tuple((1, int(p)) if i % 2 else (0, p) for i, p in enumerate(parts))


def combine(stats: list[ErrorStats]) -> ErrorStats:
    """The figures of several tensors taken together (a checkpoint's overall SQNR): sums added
    exactly (math.fsum), so the order of the tensors (a sharded set's) changes no digit."""
    return ErrorStats(
        numel=sum(s.numel for s in stats),
        sq_error=math.fsum(s.sq_error for s in stats),
        sq_signal=math.fsum(s.sq_signal for s in stats),
        max_abs=max((s.max_abs for s in stats), default=0.0),
        sq_error_minmax=_minmax_total(stats),
    )


def _minmax_total(stats: list[ErrorStats]) -> float | None:
    """The squared error had every tensor used min-max: a tensor that did counts at its own
    error (a recipe or a budget mixes range methods); None when none searched."""
    if all(s.sq_error_minmax is None for s in stats):
        return None
    return math.fsum(s.sq_error if s.sq_error_minmax is None else s.sq_error_minmax for s in stats)


POOL_QUANTIZED = "quantized"  # the overall figures pool the tensors restored from codes
POOL_ALL = "all"  # ... every tensor compared with figures (kept ones count at zero error)


def measured_as(dtypes: list[str]) -> str:
    """What the figures measure, for a header: 'as restored to BF16' (numerics/metrics.py)."""
    kinds = sorted(set(dtypes))
    if not kinds:
        return "as stored"
    if len(kinds) == 1:
        return f"as restored to {kinds[0]}"
    return f"as restored to each tensor's dtype ({', '.join(kinds)})"


def _restored_dtype(row: QuantizeRow) -> str:
    """The dtype a consumer restores a quantized tensor to: its own, or F32 for a GGUF type
    (ggml dequantizes to float32)."""
    return row.spec.restored_dtype(row.dtype) if row.spec is not None else row.dtype


@dataclass(frozen=True)
class Trial:
    """One candidate the error budget tried on a tensor: its fitted spec, the SQNR it gave and
    its bytes."""

    spec: Codec
    sqnr_db: float
    nbytes: int


@dataclass(frozen=True)
class RuleRef:
    """The rule whose pattern matched a tensor: where it comes from (`recipe`, `exclude`,
    `include`), its number there, its pattern, and for a recipe's its file and line."""

    source: str
    number: int
    pattern: str
    file: str | None = None
    line: int = 0


@dataclass(frozen=True)
class DecidedBy:
    """What decided a tensor's fate, as reports show it (engine/decision.py's Decision): the
    action (`quantize` with `spec`, or `keep` with the `reason`; a quantized tensor's reason is
    how its spec was adapted or chosen), the `origin` (`default`, `not-included`, `exclude`,
    `include`, `recipe`, `budget`, `fused-siblings`, `format`, `keep-nonfinite`, `calibrated`)
    with its facts, and the decisions it superseded, oldest first."""

    action: str
    origin: str
    spec: Codec | None = None
    reason: str = ""
    history: tuple[DecidedBy, ...] = ()
    rule: RuleRef | None = None
    target_sqnr_db: float | None = None
    trials: tuple[Trial, ...] = ()
    fused: str | None = None
    format: str | None = None
    nonfinite: int | None = None
    method: str | None = None  # origin calibrated: the method that produced the codes


class Row(Protocol):
    """What sorting, tables, gates and plots read of any command's rows."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def detail(self) -> str: ...
    @property
    def errors(self) -> ErrorStats | None: ...
    @property
    def dtypes(self) -> tuple[str, str]:
        """(in, out), or (A, B): the dtypes as stored on each side."""

    @property
    def size(self) -> int:
        """Bytes of the input (A) side: what --sort size orders by."""

    @property
    def dimmed(self) -> bool:
        """Shown faint: a tensor kept as it is, or a mismatch."""


@dataclass(frozen=True)
class QuantizeRow:
    """One tensor of a quantize run: what was done and what it cost."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype in the input
    out_dtype: str
    quantized: bool
    detail: str  # e.g. "sym int8 axis 0", or why it was kept
    bytes_in: int
    bytes_out: int  # the tensor in the output file (codes, or the tensor as it is)
    errors: ErrorStats | None = None
    scale_range: tuple[float, float] | None = None
    spec: Codec | None = None  # the spec it was quantized with
    spec_chosen: bool = False  # a recipe rule or the error budget chose `spec`
    bytes_qparams: int = 0  # its scales and zero points (in the sidecar)
    decided_by: DecidedBy | None = None  # what decided it (None: a row built by hand)
    weighted: WeightedError | None = None  # --imatrix: the activation-weighted error

    @property
    def dtypes(self) -> tuple[str, str]:
        return self.dtype, self.out_dtype

    @property
    def size(self) -> int:
        return self.bytes_in

    @property
    def dimmed(self) -> bool:
        return not self.quantized


@dataclass(frozen=True)
class CompareRow:
    """One tensor name of `compare`: its dtype and bytes as stored in A and in B ("-" and 0 on
    a side that lacks it) and how the two compare."""

    name: str
    shape: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    detail: str  # "dequantized vs F32", "shape mismatch: ...", "missing in B"
    bytes_a: int
    bytes_b: int
    errors: ErrorStats | None = None
    compared: bool = False  # both sides' values were examined (figures or equality)
    mismatch: bool = False  # missing on one side, or shapes/dtype kinds/values that differ
    missing_in: str | None = None  # "A" or "B": the side that lacks the tensor
    restored: str | None = None  # the dtype a side quantized was restored to (None: neither)
    codes_a: str | None = None  # the dtype a table shows (I4 for 4-bit codes stored as U8)
    codes_b: str | None = None  # None: as stored

    @property
    def dtypes(self) -> tuple[str, str]:
        """As a table shows them: 4-bit codes as I4, not the U8 bytes holding them."""
        return self.codes_a or self.dtype_a, self.codes_b or self.dtype_b

    @property
    def size(self) -> int:
        return self.bytes_a

    @property
    def dimmed(self) -> bool:
        return self.mismatch


@dataclass(frozen=True)
class AllocationPlan:
    """An allocation target's plan (engine/allocate.py): what it aimed at, the output's tensor
    payload it plans (bytes, bits per weight), its predicted loss and how it splits by spec."""

    target: str  # 'size', 'bpw' or 'kl'
    target_value: float  # bytes, bits per weight, or nats per token
    nbytes: int
    bpw: float
    loss: float
    measured: bool  # the loss is a predicted KL (sensitivities given), else relative error
    granularity: int  # the solver's byte unit (1: exact optimum)
    by_spec: tuple[tuple[str, int, int], ...]  # (candidate label, tensors, bytes), by label
    sum_alpha_r: float = math.nan  # S, the linear model's sum (loss is joint fit(S), else S)
    joint_fit: bool = False  # loss is the imatrix's joint fit of S (qtool.sensitivity.joint)
    kept_without_alpha: int = 0  # decided tensors the sensitivities lack, kept float
    measured_kl: float = math.nan  # a KL target's plan, measured (engine/plan_kl.py; NaN: not)
    solves: int = 0  # a KL target's solves (each plan but the last measured over the target)
    measured_on: str = ""  # where measured_kl was measured, or why it was not
    rounds: tuple[tuple[int, float, float], ...] = ()  # per solve: bytes, predicted, measured


@dataclass(frozen=True)
class ModelKL:
    """A calibrated run's model-level figure on one stream (engine/methods/verdict.py): the mean
    KL(float || quantized) per scored token, in nats, of the result the guard chose and of
    round to nearest on the same grid."""

    stream: str  # "held-out" or "check text"
    tokens: int  # scored positions
    chosen: float
    rounding: float

    @property
    def ratio(self) -> float:
        """chosen / rounding: 1 when both are 0, +inf when only rounding's is (NaN stays)."""
        if self.rounding == 0.0:
            return 1.0 if self.chosen == 0.0 else math.inf
        return self.chosen / self.rounding


@dataclass(frozen=True)
class QuantizeSummary:
    inputs: list[str]
    outputs: list[str]
    rows: list[QuantizeRow]
    spec: Codec
    device: str
    dry_run: bool = False
    skipped: list[str] = field(default_factory=list)  # non-tensor pickle entries
    stale_temps_removed: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # files not copied along, and why
    # --target-sqnr: the output size with the budget's tensors all int8 / all float
    budget_sizes: tuple[int, int] | None = None
    budget_reference: str = "int8"  # what the budget's all-8-bit reference stores as ("Q8_0")
    format: str = FormatName.QTOOL.value
    ignore: list[str] | None = None  # compressed-tensors: the Linears kept in float
    imatrix: dict[str, object] | None = None  # --imatrix: its provenance (engine/importance.py)
    texts: tuple[TextUse, ...] = ()  # the texts a method or an imatrix used (calibration.py)
    model_kl: tuple[ModelKL, ...] = ()  # --method: the model's KL at the end of the run
    allocation: AllocationPlan | None = None  # --target-size/--target-bpw/--target-kl's plan
    remarks: list[str] = field(default_factory=list)  # notes under the table, not warnings

    @property
    def weighted_overall(self) -> WeightedError | None:
        """The weighted error pooled over the tensors that have one (None: no --imatrix)."""
        parts = [r.weighted for r in self.rows if r.weighted is not None]
        if not parts:
            return None
        return WeightedError(sum(p.sq_signal for p in parts), sum(p.sq_error for p in parts))

    @property
    def quantized(self) -> list[QuantizeRow]:
        return [r for r in self.rows if r.quantized]

    @property
    def per_tensor_specs(self) -> bool:
        """A recipe or the error budget chose some tensor's spec (not the command line)."""
        return any(r.spec_chosen for r in self.rows)

    @property
    def by_spec(self) -> list[tuple[str, int, int]]:
        """What was written, as llama-quantize counts it by type: (the spec each tensor was
        quantized with, how many tensors, their bytes with qparams), most tensors first."""
        counts: dict[str, list[int]] = {}
        for r in self.quantized:
            label = r.spec.describe() if r.spec is not None else r.out_dtype
            entry = counts.setdefault(label, [0, 0])
            entry[0] += 1
            entry[1] += r.bytes_out + r.bytes_qparams
        ordered = sorted(counts.items(), key=lambda kv: (-kv[1][0], kv[0]))
        return [(label, n, nbytes) for label, (n, nbytes) in ordered]

    @property
    def bytes_in(self) -> int:
        return sum(r.bytes_in for r in self.rows)

    @property
    def bytes_out(self) -> int:
        """Everything the output holds: tensors and codes, scales and zero points."""
        return sum(r.bytes_out + r.bytes_qparams for r in self.rows)

    @property
    def overall(self) -> ErrorStats | None:
        """The quantized tensors pooled (`pooled_over`)."""
        stats = [r.errors for r in self.rows if r.errors is not None]
        return combine(stats) if stats else None

    @property
    def pooled_over(self) -> str:
        return POOL_QUANTIZED

    @property
    def measured(self) -> str | None:
        """What the figures measure ('as restored to BF16'); None when nothing was measured."""
        dtypes = [_restored_dtype(r) for r in self.rows if r.errors is not None]
        return measured_as(dtypes) if dtypes else None


@dataclass(frozen=True)
class CompareSummary:
    inputs: list[str]  # [A, B]; A is the reference
    rows: list[CompareRow]
    pool: str = POOL_QUANTIZED  # what `overall` pools (see pooled_over)

    @property
    def compared(self) -> list[CompareRow]:
        return [r for r in self.rows if r.compared]

    @property
    def mismatches(self) -> list[CompareRow]:
        return [r for r in self.rows if r.mismatch]

    @property
    def pooled_over(self) -> str:
        """POOL_QUANTIZED: the tensors a side restored from codes (what quantize pools), the
        default; POOL_ALL: every tensor with figures, asked for, or when neither side holds a
        quantized tensor."""
        if self.pool == POOL_QUANTIZED and any(r.restored for r in self._measured):
            return POOL_QUANTIZED
        return POOL_ALL

    @property
    def overall(self) -> ErrorStats | None:
        quantized_only = self.pooled_over == POOL_QUANTIZED
        stats = [r.errors for r in self._measured if r.restored or not quantized_only]
        return combine([s for s in stats if s is not None]) if stats else None

    @property
    def measured(self) -> str | None:
        """What the figures measure ('as restored to BF16', 'as stored' when neither side
        is quantized); None when no tensor has figures."""
        if not self._measured:
            return None
        return measured_as([r.restored for r in self._measured if r.restored])

    @property
    def _measured(self) -> list[CompareRow]:
        return [r for r in self.rows if r.errors is not None]


@dataclass(frozen=True)
class DequantizedRow:
    name: str
    shape: tuple[int, ...]
    dtype: str  # as written
    restored: bool  # True: dequantized from codes; False: copied byte for byte, or cast
    bytes_out: int
    cast: bool = False  # not quantized, converted to the float dtype --to asked for


@dataclass(frozen=True)
class DequantizeSummary:
    inputs: list[str]
    sidecars: list[str]
    outputs: list[str]
    rows: list[DequantizedRow]
    notes: list[str] = field(default_factory=list)  # files not copied along, and why


@dataclass(frozen=True)
class InspectRow:
    name: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int
    qinfo: dict[str, object] | None = None  # scheme, dtype, axis, scale range, orig dtype


@dataclass(frozen=True)
class TypeTotal:
    """A file's tensors of one stored type (a GGUF type: 'Q4_K'), for inspect's totals."""

    dtype: str
    tensors: int
    numel: int
    nbytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.numel if self.numel else 0.0


@dataclass(frozen=True)
class InspectSummary:
    path: str
    kind: str  # "checkpoint", "quantized", "sidecar", "sharded", "gguf"
    rows: list[InspectRow]
    metadata: dict[str, str] | None = None
    manifest: dict[str, object] | None = None
    notes: list[str] = field(default_factory=list)  # warnings: a missing sidecar, ...
    shards: int = 0
    quantized_modules: int | None = None  # compressed-tensors: modules its config quantizes
    ignore: list[str] | None = None  # compressed-tensors: the config's `ignore` list
    type_totals: list[TypeTotal] | None = None  # GGUF: per type, most bytes first

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    @property
    def total_numel(self) -> int:
        return sum(r.numel for r in self.rows)
