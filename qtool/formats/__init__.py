"""On-disk formats, one package per format behind one protocol (base.py):

  qtool/               codes + a qparams sidecar (qtool's own)
  compressed_tensors/  Hugging Face model directories transformers and vLLM load
  dense/               plain float checkpoints (read; what dequantize writes)
  gguf/                llama.cpp's GGUF files (read any; quantize a float one to GGUF types)

Each package registers itself on import (registry.py: by name, what it reads, inspects and
writes) with its detectors (detect.py: `detect(path)`, one priority order for every command);
builtins.py lists the packages. The engine imports only base, detect and registry from here (an
import-linter contract holds it), so a new format is a package and a line in builtins.py.
listing.py holds what the formats' `inspect` share.
imatrix/ reads and writes llama.cpp's importance-matrix files (statistics, not a checkpoint:
nothing registers it).
"""
