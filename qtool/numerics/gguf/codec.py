"""GGUFSpec's kernels as numerics/kernels.py dispatches to them: quantize a tensor to its
blocks, restore it as ggml does, and tell the kernel choice a run's work up front."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from qtool.numerics import gguf
from qtool.numerics.gguf import fast
from qtool.numerics.gguf.tensor import ImportanceOverflow, quantize_tensor
from qtool.numerics.kernels import Kernels, QuantizedTensor, Work, Workspace
from qtool.numerics.range_methods import ColumnWeights
from qtool.spec import GGUFSpec


def quantize(
    x: torch.Tensor,
    spec: GGUFSpec,
    *,
    with_errors: bool,
    scale_dtype: torch.dtype,
    workspace: Workspace | None,
    weights: ColumnWeights | None = None,
) -> QuantizedTensor:
    """x's rows as `spec`'s blocks (tensor.py; the scale dtype and workspace mean nothing to
    them: the block's own fp16 scales are stored); `weights`, an importance matrix's h per
    input column (one row per expert of [E, out, in]), go to ggml's quantizers as their
    quant_weights, as llama-quantize --imatrix hands them."""
    qw = None if weights is None else weights.h.to(x.device)
    try:
        return quantize_tensor(x, spec, with_errors=with_errors, quant_weights=qw)
    except ImportanceOverflow as err:
        if weights is None or not weights.source:
            raise
        raise ImportanceOverflow(err.type_name, err.largest, weights.source) from None


def restored(x: torch.Tensor, spec: GGUFSpec) -> torch.Tensor:
    """x's blocks dequantized as ggml does (float32)."""
    blocks = quantize_tensor(x, spec, with_errors=False).q
    return gguf.dequantize(blocks, spec.gguf).view(x.shape)


def expect(device: torch.device, work: Sequence[Work]) -> None:
    """The GGUF kernels choose by the whole run's work too (on the CPU): one slab at a time,
    each call would look too small to be worth loading numba for."""
    if device.type == "cpu":
        specs = [(shape, s) for shape, _, s in work if isinstance(s, GGUFSpec)]
        fast.expect(
            sum(fast.torch_seconds(s.gguf.name, math.prod(shape), True) for shape, s in specs)
        )


def restore_rows(
    result: QuantizedTensor, spec: GGUFSpec, a: int, b: int, x: torch.Tensor
) -> torch.Tensor:
    """Rows a:b of the tensor's blocks in `result`, dequantized as ggml does (float32)."""
    shape = tuple(x.shape)
    per_row = math.prod(shape[1:-1])
    return gguf.dequantize(result.q[a * per_row : b * per_row], spec.gguf).view(shape)


KERNELS = Kernels(quantize, restored, expect, restore_rows)
