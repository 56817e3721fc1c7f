"""One tensor quantized with any spec, what the quantize loop and the error budget call: qtool's
integer grids through select.py (the torch or the fused kernels, as QTOOL_KERNEL says), and
llama.cpp's GGUF block types through numerics/gguf (which choose their kernels themselves)."""

from __future__ import annotations

import torch

from qtool.numerics import select
from qtool.numerics.kernels import QuantizedTensor, Workspace
from qtool.numerics.range_methods import ColumnWeights
from qtool.spec import QSpec


def quantize_tensor(
    x: torch.Tensor,
    spec: QSpec,
    *,
    with_errors: bool = True,
    scale_dtype: torch.dtype = torch.float32,
    workspace: Workspace | None = None,
    weights: ColumnWeights | None = None,
) -> QuantizedTensor:
    """x quantized with `spec` (see select.quantize_tensor); a GGUF type gives its blocks
    (numerics/gguf/tensor.py: `scale_dtype` and `workspace` mean nothing to them; `weights`
    are refused until the GGUF kernels take an importance matrix)."""
    if spec.gguf is not None:
        if weights is not None:
            raise ValueError("GGUF types do not take an importance matrix yet")
        from qtool.numerics.gguf.tensor import quantize_tensor as quantize_blocks

        return quantize_blocks(x, spec, with_errors=with_errors)
    return select.quantize_tensor(
        x, spec, with_errors=with_errors, scale_dtype=scale_dtype, workspace=workspace,
        weights=weights,
    )  # fmt: skip
