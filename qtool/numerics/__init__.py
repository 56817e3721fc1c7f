"""The numeric core: granularities, range methods, grouped quantization and packing; no I/O."""
