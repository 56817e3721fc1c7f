"""Numeric core: quantization kernels, ranges, packing and error metrics (torch, no I/O)."""
