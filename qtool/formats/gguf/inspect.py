"""`qtool inspect model.gguf`: summary.summarize's view as the InspectSummary every format gives
(a row per tensor in torch order with its GGUF type as dtype, totals by type, and the key
metadata: architecture, name, block count, context length, vocabulary size, file type).
From the header alone; torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.formats.gguf.summary import GGUFSummary, summarize
from qtool.io.gguf_file import GGUFFile
from qtool.results import InspectRow, InspectSummary

if TYPE_CHECKING:
    from qtool.formats.imatrix.sensitivity import Sensitivities
    from qtool.io.gguf_layout import GGUFValue

KIND = "gguf"


def inspect(path: Path) -> InspectSummary:
    with GGUFFile(path) as f:
        summary = summarize(str(path), f.header)
        found = _sensitivities(f.header.metadata)
    rows = [InspectRow(r.name, r.gguf_type, r.shape, r.numel, r.nbytes) for r in summary.rows]
    metadata = key_metadata(summary)
    if found is not None:
        metadata[SENSITIVITIES] = found
    return InspectSummary(str(path), KIND, rows, metadata, type_totals=summary.totals)


SENSITIVITIES = "qtool.sensitivity"


def _sensitivities(metadata: Mapping[str, GGUFValue]) -> str | None:
    """calibrate --sensitivity's keys in an imatrix GGUF, in one line (inspect shows a file
    whose keys are malformed, saying so; quantize refuses it). Torch is loaded (by the fit's
    numerics) only for a file that holds them."""
    if not any(key.startswith(SENSITIVITIES + ".") for key in metadata):
        return None
    from qtool.formats.imatrix.sensitivity import parse

    try:
        found = parse(metadata)
    except ValueError as err:
        return f"malformed: {err}"
    return None if found is None else sensitivities_text(found)


def sensitivities_text(found: Sensitivities) -> str:
    """What calibrate --sensitivity stored in an imatrix GGUF, in one line."""
    joint = (
        "no joint fit (predicted KL = sum alpha r)"
        if found.joint is None
        else "joint fit: gain {:.4g}, saturation {:.4g}, additivity {:.4g}".format(*found.joint)
    )
    return (
        f"sensitivities of {len(found.alpha)} weights, reference {found.reference}, "
        f"{found.tokens} tokens, {joint}"
    )


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
