"""Fused CPU kernels (numba): range, codes and error sums in one pass over each row or group.

The contract: bit-exact with the torch kernels (numerics/kernels.py; semantics: docs/numerics.md).
Statistics and qparams in float32, lo = min(min(x), 0), hi = max(max(x), 0),
q = clamp(rint(x / scale) + zp, qmin, qmax) with a float32 DIVISION and round-half-to-even;
x_hat = (q - zp) * scale in float32. Error figures are numerics/metrics.py's, to the last bit:
x_hat rounded to the input's dtype, the canonical chunk sums (fused_sums.py) added exactly.
Inputs are read in their own dtype (bf16 and fp16 as raw 16-bit words, decoded in the loop): no
full-size float32 copy exists. `--range mse` is fused for rows and groups (per channel on axis
0, per group); its choice equals the torch path's except where two candidates' float64 error
sums agree to their rounding, where summation order decides (as it does between torch on CPU
and CUDA).

Importing this module imports numba; numerics/select.py decides whether that happens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numba
import numpy as np
import torch

from qtool.numerics import fused_jit as jit
from qtool.numerics import numba_pool
from qtool.numerics.fused_sums import key_value
from qtool.numerics.kernels import QuantizedTensor
from qtool.numerics.metrics import CHUNK, chunk_count, exact_sum, unit_elems
from qtool.numerics.range_methods import check_grid_finite, search_candidates
from qtool.numerics.ranges import IntRange, NonFiniteInput
from qtool.numerics.views import normalize_spec
from qtool.results import ErrorStats
from qtool.spec import (
    PerChannel,
    PerGroup,
    PerTensor,
    QSpec,
    RangeMethod,
    matrix_shape,
    qparam_shape,
)

SEG_BLOCK = 1 << 12  # per-tensor segment: 16 KiB of float32 (and its errors) stay in L1
MIN_SEG = 256  # shorter runs per channel go through the column kernels
_SCALE_KINDS = {torch.float32: jit.SCALE_F32, torch.bfloat16: jit.SCALE_BF16}
_SCALE_KINDS[torch.float16] = jit.SCALE_F16

Grid = tuple[bool, np.float32, np.float32, np.float32, np.float32, int]


@dataclass(frozen=True)
class Fused:
    """Codes (original shape, or packed uint8 [..., ceil(last / 2)]), qparams, error sums."""

    codes: np.ndarray
    scale: np.ndarray  # float32, the qparam shape
    zero_point: np.ndarray  # float32 holding integers, the qparam shape
    errors: ErrorStats | None
    choice: np.ndarray | None = None  # uint8, the qparam shape (--range mse)


def set_threads(n: int) -> None:
    """Run the parallel kernels on n threads (as many as torch uses; numba's pool is the cap)."""
    numba_pool.start()
    n = max(1, min(n, vars(numba.config)["NUMBA_NUM_THREADS"]))
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)


def warm_up() -> None:
    """Load the machine code of the common kernels (fp32 and bf16 rows, 8-bit codes) and start
    numba's thread pool, so that the first real tensor pays only its own time."""
    numba_pool.start()
    for dtype in (torch.float32, torch.bfloat16):
        quantize_tensor(torch.zeros(2, 2, dtype=dtype), QSpec())


def supports(spec: QSpec, ndim: int) -> bool:
    """Whether the fused kernels cover this spec on a tensor of `ndim` dims (the mse search is
    fused for rows and groups only; 0-d tensors stay on the torch path)."""
    if ndim == 0:
        return False
    return spec.range_method is RangeMethod.MINMAX or _row_layout(spec, ndim)


def quantize_tensor(
    x: torch.Tensor,
    spec: QSpec,
    *,
    with_errors: bool = True,
    scale_dtype: torch.dtype = torch.float32,
) -> QuantizedTensor:
    """kernels.quantize_tensor on the CPU, bit for bit (see module doc); `supports` must hold."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"can only quantize float16/bfloat16/float32/float64, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError("cannot quantize an empty tensor")
    if not supports(spec, x.ndim):
        raise ValueError(f"the fused kernels do not cover {spec.describe()} on a {x.ndim}-D tensor")
    if scale_dtype not in _SCALE_KINDS:
        raise ValueError(f"scales can be stored as float32, bfloat16 or float16, not {scale_dtype}")
    spec = normalize_spec(spec, x.ndim)
    words = tensor_words(x)
    r = quantize(words, spec, with_errors=with_errors, scale_kind=_SCALE_KINDS[scale_dtype])
    scale, zp = torch.from_numpy(r.scale), torch.from_numpy(r.zero_point)
    check_grid_finite(scale, zp, spec)
    storage = torch.int8 if spec.dtype.signed else torch.uint8
    choice = torch.from_numpy(r.choice) if r.choice is not None else None
    return QuantizedTensor(torch.from_numpy(r.codes), scale, zp.to(storage), r.errors, choice)


def tensor_words(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor's storage as the array the kernels read (bf16 as uint16, fp16 as int16
    words; no copy when contiguous)."""
    x = x.contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.view(torch.int16).numpy() if x.dtype == torch.float16 else x.numpy()


def quantize(
    words: np.ndarray, spec: QSpec, *, with_errors: bool = True, scale_kind: int = 0
) -> Fused:
    """The fused kernels on an array from `tensor_words` (spec axis normalised)."""
    grid = _grid(spec, scale_kind)
    gran = spec.granularity
    axis = gran.axis if isinstance(gran, PerChannel) else 0
    if _row_layout(spec, words.ndim):
        cands = np.asarray(search_candidates(spec, words.shape), np.float32)
        result = _by_rows(words, spec, grid, cands, with_errors)
    elif axis > 0 and _segment(words.shape, spec) < MIN_SEG:
        result = _by_columns(words, spec, grid, axis, with_errors)
    else:
        result = _by_segments(words, spec, grid, with_errors)
    # Rows of 2+-D tensors are packed in the row kernel; everything else is packed here.
    in_kernel = _row_layout(spec, words.ndim) and words.ndim >= 2
    return _packed(result, spec) if spec.dtype.packed and not in_kernel else result


def dequantize_tensor(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    spec: QSpec,
    dtype: torch.dtype,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """kernels.dequantize on the CPU, bit for bit: (q - zp) * scale in float32, stored as
    `dtype` (round half to even); 4-bit codes packed two per byte are unpacked to `shape`."""
    if q.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"codes must be int8 or uint8, got {q.dtype}")
    spec = normalize_spec(spec, len(shape))
    codes = q.contiguous().numpy()
    if spec.dtype.packed:
        codes = _unpack(codes, spec, shape)
    out = torch.empty(shape, dtype=dtype)
    target = tensor_words(out) if dtype in (torch.bfloat16, torch.float16) else out.numpy()
    s = scale.float().contiguous().numpy().reshape(-1)
    z = zero_point.float().contiguous().numpy().reshape(-1)
    if _row_layout(spec, len(shape)):
        rows = shape[0]
        gsize = spec.granularity.size if isinstance(spec.granularity, PerGroup) else codes.size
        gsize = min(gsize, codes.size // rows)
        jit.dq_rows(codes.reshape(rows, -1), gsize, s.reshape(rows, -1), z.reshape(rows, -1),
                    target.reshape(rows, -1))  # fmt: skip
    else:
        seg = _segment(shape, spec)
        jit.dq_segs(codes.reshape(-1), seg, s, z, target.reshape(-1))
    return out


def _row_layout(spec: QSpec, ndim: int) -> bool:
    """Groups of the [C, K] rows: per group, or per channel on axis 0 of a 2+-D tensor."""
    g = spec.granularity
    return isinstance(g, PerGroup) or (isinstance(g, PerChannel) and g.axis == 0 and ndim >= 2)


def _grid(spec: QSpec, scale_kind: int) -> Grid:
    r = IntRange.of(spec)
    steps = r.qmax - r.qmin
    divisor = steps / 2 if r.symmetric else steps
    f = np.float32
    return (r.symmetric, f(divisor), f(r.qmin), f(r.qmax), f(r.sym_zero_point), scale_kind)


def _storage(spec: QSpec) -> type[np.integer]:
    return np.int8 if spec.dtype.signed else np.uint8


def _offset(spec: QSpec) -> int:
    """What packing adds to a code to make it an unsigned nibble."""
    return 8 if spec.dtype.signed else 0


def _by_rows(
    words: np.ndarray, spec: QSpec, grid: Grid, cands: np.ndarray, with_errors: bool
) -> Fused:
    """Per channel on axis 0 (one group per row) or per group: the [C, K] row kernel, with
    packing of 4-bit codes done per row while it is in cache."""
    rows = words.shape[0]
    x2 = words.reshape(rows, -1)
    k = x2.shape[1]
    gran = spec.granularity
    gsize = min(gran.size, k) if isinstance(gran, PerGroup) else k
    ng = -(-k // gsize)
    out = (
        np.empty((rows, ng), np.float32),
        np.empty((rows, ng), np.float32),
        np.zeros((rows, ng), np.uint8),
    )
    lay = layout(words.shape)
    sums = _sums(lay, lay[3] // lay[1], with_errors, 3)  # threads own units of rows
    status = np.zeros(rows, np.int64)
    width = words.shape[-1] if spec.dtype.packed and words.ndim >= 2 else 0
    if width:
        codes = np.empty((*words.shape[:-1], (width + 1) // 2), np.uint8)
        template, packed = np.empty((1, k), _storage(spec)), codes.reshape(rows, -1)
    else:
        codes = np.empty(words.shape, _storage(spec))
        template, packed = codes.reshape(rows, k), np.empty((1, 1), np.uint8)
    pack = (width, _offset(spec), packed)
    jit.rows_kernel(x2, gsize, grid, cands, template, out, status, with_errors, pack, *sums)
    _raise_for(int(status.max(initial=0)), words)
    shape = qparam_shape(gran, words.shape)
    scale, zp = out[0].reshape(shape), out[1].reshape(shape)
    errors = _errors(sums, words.size, with_errors)
    if not cands.size:
        return Fused(codes, scale, zp, errors)
    if errors is not None:
        errors = replace(errors, sq_error_minmax=exact_sum(sums[0][2].tolist()))
    return Fused(codes, scale, zp, errors, out[2].reshape(shape))


def _by_columns(words: np.ndarray, spec: QSpec, grid: Grid, axis: int, with_errors: bool) -> Fused:
    """Per channel on an axis with few elements after it: rows of C * post, qparams per column."""
    channels, post = words.shape[axis], math.prod(words.shape[axis + 1 :])
    x2 = words.reshape(-1, channels * post)
    klo, khi = jit.cols_keys(x2, min(x2.shape[0], 16))
    # (nch, C * post) partials -> (nch * post, C): every row of a column group is one partial
    klo = np.ascontiguousarray(
        klo.reshape(-1, channels, post).transpose(0, 2, 1).reshape(-1, channels)
    )
    khi = np.ascontiguousarray(
        khi.reshape(-1, channels, post).transpose(0, 2, 1).reshape(-1, channels)
    )
    scale, zp = np.empty(channels, np.float32), np.empty(channels, np.float32)
    _raise_for(int(jit.qparams_many(klo, khi, grid, scale, zp)), words)
    codes = np.empty(words.shape, _storage(spec))
    lay = layout(words.shape)
    sums = _sums(lay, lay[3], with_errors, 2)
    scale_w, zp_w = np.repeat(scale, post), np.repeat(zp, post)
    flat = words.reshape(-1)
    jit.cols_codes(flat, scale_w, zp_w, grid, codes.reshape(-1), with_errors, lay, *sums)
    return Fused(codes, scale, zp, _errors(sums, words.size, with_errors))


def _segment(shape: tuple[int, ...], spec: QSpec) -> int:
    """Run length whose qparams index cycles mod C: `post` per channel, a block per tensor."""
    g = spec.granularity
    if isinstance(g, PerChannel):
        return max(1, math.prod(shape[g.axis + 1 :]))
    return SEG_BLOCK


def _by_segments(words: np.ndarray, spec: QSpec, grid: Grid, with_errors: bool) -> Fused:
    """Per tensor, or per channel on an axis > 0: a range pass, then a codes pass."""
    seg = _segment(words.shape, spec)
    gran = spec.granularity
    nq = words.shape[gran.axis] if isinstance(gran, PerChannel) else 1
    x1 = words.reshape(-1)
    nseg = -(-x1.size // seg)
    nrows = -(-nseg // nq)
    klo, khi = jit.segs_keys(x1, seg, nq, min(nrows, 64))
    scale = np.empty(nq, np.float32)
    zp = np.empty(nq, np.float32)
    _raise_for(int(jit.qparams_many(klo, khi, grid, scale, zp)), words)
    codes = np.empty(words.shape, _storage(spec))
    lay = layout(words.shape)
    sums = _sums(lay, lay[3], with_errors, 2)
    jit.segs_codes(x1, seg, grid, scale, zp, codes.reshape(-1), with_errors, lay, *sums)
    shape = qparam_shape(gran, words.shape)
    return Fused(
        codes, scale.reshape(shape), zp.reshape(shape), _errors(sums, x1.size, with_errors)
    )


def _packed(result: Fused, spec: QSpec) -> Fused:
    """Pack codes computed unpacked (per tensor, other axes, 1-D tensors)."""
    codes = result.codes
    width = codes.shape[-1]
    packed = np.empty((*codes.shape[:-1], (width + 1) // 2), np.uint8)
    zp = result.zero_point.reshape(-1)
    # 1-D per channel/group: element i is row i, so its zero point is zp[i].
    per_tensor = isinstance(spec.granularity, PerTensor)
    seg = 1 if codes.ndim == 1 and not per_tensor else _segment(codes.shape, spec)
    jit.pack_flat(codes.reshape(-1), width, _offset(spec), seg, zp, packed.reshape(-1))
    return replace(result, codes=packed)


def _unpack(packed: np.ndarray, spec: QSpec, shape: tuple[int, ...]) -> np.ndarray:
    width = shape[-1] if shape else 1
    if packed.shape != (*shape[:-1], (width + 1) // 2) or packed.dtype != np.uint8:
        raise ValueError(f"codes of shape {packed.shape} are neither {shape} nor packed")
    codes = np.empty(shape, _storage(spec))
    jit.unpack_flat(packed.reshape(-1), width, _offset(spec), codes.reshape(-1))
    return codes


Layout = tuple[int, int, int, int]
Sums = tuple[tuple[np.ndarray, ...], np.ndarray]


def layout(shape: tuple[int, ...]) -> Layout:
    """(K, chunks per unit, elements per unit, chunks) of metrics.py's chunks of a tensor."""
    _, k = matrix_shape(shape)
    return (k, 1 if k <= CHUNK else -(-k // CHUNK), unit_elems(shape), chunk_count(shape))


def _sums(lay: Layout, units: int, with_errors: bool, kinds: int) -> Sums:
    """Slots for the chunk sums (x^2, e^2 and, for the row kernel, min-max's e^2) and the
    per-thread largest |e| of a kernel over `units` work units (at most 256 threads)."""
    n = lay[3] if with_errors else 0
    parts = tuple(np.zeros(n) for _ in range(kinds))
    return parts, np.zeros(max(1, min(units, 256)), np.int32)


def _errors(sums: Sums, numel: int, with_errors: bool) -> ErrorStats | None:
    if not with_errors:
        return None
    parts, kmax = sums
    return ErrorStats(
        numel=numel,
        sq_error=exact_sum(parts[1].tolist()),
        sq_signal=exact_sum(parts[0].tolist()),
        max_abs=key_value(kmax),
    )


def _raise_for(status: int, words: np.ndarray) -> None:
    """Turn a kernel status into the torch path's exceptions."""
    if status == jit.NONFINITE:
        raise NonFiniteInput(_count_nonfinite(words))
    if status == jit.OVERFLOW:
        raise ValueError("value range overflows float32; quantize such tensors symmetrically")


def _count_nonfinite(words: np.ndarray) -> int:
    """NaN/Inf values in the input's own dtype (as the torch path counts them)."""
    if words.dtype == np.uint16:
        return int(np.count_nonzero((words & 0x7F80) == 0x7F80))
    if words.dtype == np.int16:
        return int(np.count_nonzero((words & 0x7C00) == 0x7C00))
    return int(np.count_nonzero(~np.isfinite(words)))
