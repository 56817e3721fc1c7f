"""`qtool inspect model.gguf`: summary.summarize's view as the InspectSummary every format gives
(a row per tensor in torch order with its GGUF type as dtype, totals by type, and the key
metadata: architecture, name, block count, context length, vocabulary size, file type).
From the header alone; torch-free."""

from __future__ import annotations

from pathlib import Path

from qtool.formats.gguf.summary import GGUFSummary, summarize
from qtool.io.gguf_file import GGUFFile
from qtool.results import InspectRow, InspectSummary

KIND = "gguf"


def inspect(path: Path) -> InspectSummary:
    with GGUFFile(path) as f:
        summary = summarize(str(path), f.header)
    rows = [InspectRow(r.name, r.gguf_type, r.shape, r.numel, r.nbytes) for r in summary.rows]
    return InspectSummary(str(path), KIND, rows, key_metadata(summary), type_totals=summary.totals)


def key_metadata(summary: GGUFSummary) -> dict[str, str]:
    """What inspect shows of the header, as strings (only what the file says)."""
    shown: dict[str, object] = {
        "gguf_version": summary.version,
        "architecture": summary.architecture,
        "name": summary.name,
        "block_count": summary.block_count,
        "context_length": summary.context_length,
        "vocab_size": summary.vocab_size,
        "file_type": summary.file_type_name,
    }
    out = {k: str(v) for k, v in shown.items() if v is not None}
    out |= {k: v for k, v in summary.metadata.items() if k != "general.name"}
    out["metadata_keys"] = str(summary.n_metadata)
    return out
