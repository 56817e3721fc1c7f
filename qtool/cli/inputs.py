"""What each command accepts as input, in one place: the help of its arguments says it, and
tests/test_cli_help.py runs each command on each kind named here."""

from __future__ import annotations

_CHECKPOINT = (
    "a .safetensors file, a .pt/.pth/.bin state dict, a sharded checkpoint (its "
    "*.safetensors.index.json or directory) or a model directory (config.json beside the weights)"
)

QUANTIZE_INPUT = f"A float checkpoint: {_CHECKPOINT}."
DEQUANTIZE_INPUT = (
    "A quantized checkpoint: a file written by qtool quantize (its .qparams sidecar beside it), "
    "a quantized sharded set (its index or directory) or a compressed-tensors model directory."
)
COMPARE_A = (
    f"The reference, float or quantized: {_CHECKPOINT}. qtool-quantized files and "
    "compressed-tensors directories are dequantized on the fly."
)
COMPARE_B = "The checkpoint compared with A: any input A accepts."
INSPECT_INPUT = (
    f"Any checkpoint: {_CHECKPOINT}; also a qtool-quantized file, its .qparams sidecar or a "
    "compressed-tensors model directory."
)
PLOT_INPUT = "A float checkpoint file: .safetensors or a .pt/.pth/.bin state dict."
