"""On-disk formats, one package per format behind one protocol (base.py), registered by name
(registry.py) and recognised by `detect` (detect.py, one priority order for every command):

  qtool/               codes + qparams sidecar (qtool's own)
  compressed_tensors/  Hugging Face model directories transformers and vLLM load
  dense/               plain float checkpoints (read; what dequantize writes)

The engine imports only base, detect, registry and listing-free protocols from here; a new
format is a package that registers itself and a line in builtins.py.
"""
