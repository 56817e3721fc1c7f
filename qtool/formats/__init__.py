"""On-disk formats, one package per format behind one protocol (base.py):

  qtool/               codes + a qparams sidecar (qtool's own)
  compressed_tensors/  Hugging Face model directories transformers and vLLM load
  dense/               plain float checkpoints (read; what dequantize writes)
  gguf/                llama.cpp's GGUF files (read any; quantize a float one to GGUF types)

Each package's __init__ is its registration (registry.py: by name, the help line `--format`
shows, what it reads, inspects and writes, each imported on first use) with its detectors
(detect.py: `detect(path)`, one priority table for every command); builtins.py lists the
packages. The engine imports only base, detect and registry from here (an import-linter
contract holds it), so a new format is a package and its name in builtins.py
(docs/development.md says how).
listing.py holds what the formats' `inspect` share.
imatrix/ reads and writes llama.cpp's importance-matrix files (statistics, not a checkpoint:
nothing registers it).
"""
