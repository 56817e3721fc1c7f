"""What each command accepts as input, in one place: the help of its arguments says it, and
tests/cli/test_help.py runs each command on each kind named here."""

from __future__ import annotations

_CHECKPOINT = (
    "a .safetensors file, a .pt/.pth/.bin state dict, a sharded checkpoint (its "
    "*.safetensors.index.json or directory) or a model directory (config.json beside the weights)"
)

QUANTIZE_INPUT = (
    f"A float checkpoint: {_CHECKPOINT}; with --format gguf, also a float (F32/F16/BF16) GGUF "
    "file or a Hugging Face model directory of the Llama family (Llama, Qwen2, Mistral), "
    "converted as llama.cpp's convert_hf_to_gguf.py does."
)
DEQUANTIZE_INPUT = (
    "A quantized checkpoint: a file written by qtool quantize (its .qparams sidecar beside it), "
    "a quantized sharded set (its index or directory), a compressed-tensors model directory or "
    "a GGUF file (every tensor to float, GGUF names kept)."
)
COMPARE_A = (
    f"The reference, float or quantized: {_CHECKPOINT}; or a GGUF file. qtool-quantized files, "
    "compressed-tensors directories and GGUF files are dequantized on the fly; a GGUF file "
    "against the Hugging Face checkpoint it was converted from is matched by name."
)
COMPARE_B = "The checkpoint compared with A: any input A accepts."
INSPECT_INPUT = (
    f"Any checkpoint: {_CHECKPOINT}; also a qtool-quantized file, its .qparams sidecar, a "
    "compressed-tensors model directory or a GGUF file."
)
PLOT_INPUT = "A float checkpoint file: .safetensors or a .pt/.pth/.bin state dict."
EVAL_FLOAT = (
    "The float model: a Hugging Face model directory (config.json, safetensors weights, tokenizer)."
)
EVAL_QUANT = (
    "The same model quantized: a compressed-tensors model directory, a qtool-quantized file or "
    "sharded set (or its directory), a GGUF file (its tensors matched to FLOAT's names), or a "
    "float checkpoint (e.g. a dequantized one)."
)
