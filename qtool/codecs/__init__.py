"""Codecs: how one tensor's float values become stored bytes, one value type per family.

base.py defines Codec and its registry; each family's module defines one subclass, which
registers itself by its `kind` when the class is created: qtool.spec's QSpec (kind "grid":
qtool's integer grids) and gguf.py's GGUFSpec (kind "gguf": llama.cpp's block types).
qtool.spec imports every family, so whoever imports qtool.spec sees them all. Pure Python (no
torch): a codec's kernels live in numerics/, registered there by the codec's kind
(numerics/kernels.py's FAMILIES). docs/development.md, "Adding a codec", walks through adding one.
"""
