"""The one quantize dispatch: a tensor quantized with any codec, what the quantize loop, its
slabs, the batches of tiny tensors, the plots and the error budget call. Each codec family's
kernels are registered here by its kind (FAMILIES), imported on first use:

    grid  (spec.QSpec)      the torch kernels (kernels.py) or the fused ones (fused.py), called
                            here as select.py chooses (QTOOL_KERNEL); tiny tensors of one spec
                            may be stacked into one call (engine/batch.py)
    gguf  (spec.GGUFSpec)   numerics/gguf/codec.py: llama.cpp's block types (which choose
                            their kernels themselves)

A new codec family writes its Kernels and adds its line to FAMILIES."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qtool.numerics import kernels, select
from qtool.numerics.kernels import QuantizedTensor, Workspace
from qtool.numerics.range_methods import ColumnWeights
from qtool.spec import Codec, PerChannel, PerGroup, QSpec

Work = tuple[tuple[int, ...], bool, Codec]
"""One tensor a run will quantize: its shape, whether it is 16-bit (bf16/fp16), its spec."""


@dataclass(frozen=True)
class Kernels:
    """A codec family's numerics. `quantize(x, spec, *, with_errors, scale_dtype, workspace)`:
    codes, scales and zero points as the family stores them (and the error statistics of what
    a consumer restores); `restored(x, spec)`: that reconstruction as float32; `expect(device,
    work)`: told the run's work up front, to choose its kernels; `stacks`: tiny tensors of one
    spec may be quantized stacked, in one call."""

    quantize: Callable[..., QuantizedTensor]
    restored: Callable[[torch.Tensor, Any], torch.Tensor]
    expect: Callable[[torch.device, list[Work]], None]
    restore_rows: Callable[[QuantizedTensor, Any, int, int, torch.Tensor], torch.Tensor]
    stacks: bool = False


def quantize_tensor(
    x: torch.Tensor,
    spec: Codec,
    *,
    with_errors: bool = True,
    scale_dtype: torch.dtype = torch.float32,
    workspace: Workspace | None = None,
    weights: ColumnWeights | None = None,
) -> QuantizedTensor:
    """x quantized with `spec` by its family's kernels (see Kernels); `weights` (an importance
    matrix's h per input column) weigh a range search's errors where the family takes them."""
    extra = {} if weights is None else {"weights": weights}
    return family(spec).quantize(
        x, spec, with_errors=with_errors, scale_dtype=scale_dtype, workspace=workspace, **extra
    )


def restored(x: torch.Tensor, spec: Codec) -> torch.Tensor:
    """x quantized with `spec` and restored as a consumer does (in x's dtype for a grid, as
    ggml dequantizes for a GGUF type), as float32."""
    return family(spec).restored(x, spec)


def expect(device: torch.device, work: Iterable[Work]) -> None:
    """Tell every family what this run quantizes one tensor at a time on `device` (each
    chooses its kernels by the whole run's work: numerics/select.py)."""
    todo = list(work)
    for kind in FAMILIES:
        _load(kind).expect(device, [w for w in todo if w[2].kind == kind])


def restored_rows(
    result: QuantizedTensor, spec: Codec, a: int, b: int, x: torch.Tensor
) -> torch.Tensor:
    """Rows a:b (of the first dim) of a tensor as its codes in `result` restore it (`x`: those
    rows, for their shape and dtype): a grid's in x's dtype (the whole tensor when its qparams
    are not per row), a GGUF type's as ggml dequantizes its blocks (float32)."""
    return family(spec).restore_rows(result, spec, a, b, x)


def family(spec: Codec) -> Kernels:
    """The kernels of `spec`'s family."""
    return _load(spec.kind)


# -- the grid's kernels ---------------------------------------------------------------------


def _grid_quantize(
    x: torch.Tensor,
    spec: QSpec,
    *,
    with_errors: bool = True,
    scale_dtype: torch.dtype = torch.float32,
    workspace: Workspace | None = None,
    weights: ColumnWeights | None = None,
) -> QuantizedTensor:
    """The fused kernels where select.py chooses them, else the torch kernels, timed for that
    choice (the same bits either way)."""
    fused = select.fused_for(x, spec, weighted=weights is not None)
    if fused is not None:
        got: QuantizedTensor = fused.quantize_tensor(
            x, spec, with_errors=with_errors, scale_dtype=scale_dtype
        )
        return got
    started = time.perf_counter()
    result = kernels.quantize_tensor(
        x, spec, with_errors=with_errors, scale_dtype=scale_dtype, workspace=workspace,
        weights=weights,
    )  # fmt: skip
    select.measured(x, spec, started)
    return result


def _grid_restored(x: torch.Tensor, spec: QSpec) -> torch.Tensor:
    result = kernels.quantize_tensor(x, spec, with_errors=False)
    q, scale, zp = result.q, result.scale, result.zero_point
    return kernels.dequantize(q, scale, zp, spec, dtype=x.dtype, shape=x.shape).float()


def _grid_expect(device: torch.device, work: Sequence[Work]) -> None:
    grids = [
        select.Work(shape, wide, spec) for shape, wide, spec in work if isinstance(spec, QSpec)
    ]
    select.expect_work(device, grids)


def _grid_restore_rows(
    result: QuantizedTensor, spec: QSpec, a: int, b: int, x: torch.Tensor
) -> torch.Tensor:
    shape = tuple(x.shape)
    if isinstance(spec.granularity, PerGroup) or spec.granularity == PerChannel(0):
        q, scale, zp = result.q[a:b], result.scale[a:b], result.zero_point[a:b]
    else:
        q, scale, zp = result.q, result.scale, result.zero_point
    return select.dequantize(q, scale, zp, spec, x.dtype, shape)


GRID = Kernels(_grid_quantize, _grid_restored, _grid_expect, _grid_restore_rows, stacks=True)

FAMILIES: dict[str, Kernels | str] = {
    "grid": GRID,
    "gguf": "qtool.numerics.gguf.codec",  # its module's KERNELS
}


def _load(kind: str) -> Kernels:
    found = FAMILIES[kind]
    if isinstance(found, str):
        found = FAMILIES[kind] = importlib.import_module(found).KERNELS
    assert isinstance(found, Kernels)
    return found
