"""What `qtool inspect` shows of the qtool format (torch-free): a sidecar's manifest, a quantized
file's tensors with how each was quantized and the range of its scales, and whether the pair
belongs together (as notes: inspect never refuses what dequantize would)."""

from __future__ import annotations

import json
import sys
from array import array
from pathlib import Path

from qtool.errors import InputError, SidecarError
from qtool.formats import listing
from qtool.formats.detect import Detected
from qtool.formats.qtool.manifest import (
    BINDING_KEY,
    DIGEST_KEY,
    MANIFEST_KEY,
    Manifest,
    binding_digest,
    data_digest,
    locate_sidecar,
    parse_manifest,
    scale_name,
)
from qtool.io.safeopen import open_regular
from qtool.io.stformat import Header, HeaderError, read_header
from qtool.results import InspectSummary


def inspect(found: Detected) -> InspectSummary:
    """A sidecar, a quantized file, or a directory of quantized files."""
    if found.directory is not None:
        return listing.directory(found, quantized_file, "quantized", "sharded quantized")
    header = listing.try_header(found.path)
    if header is not None and MANIFEST_KEY in (header.metadata or {}):
        return sidecar(found.path, header)
    return quantized_file(found.path)


def sidecar(path: Path, header: Header) -> InspectSummary:
    metadata = header.metadata or {}
    parse_manifest(path, metadata)  # validates format and version
    rows = [listing.row(e) for e in header.tensors]
    doc = json.loads(metadata[MANIFEST_KEY])
    return InspectSummary(str(path), "sidecar", rows, metadata=None, manifest=doc)


def quantized_file(path: Path) -> InspectSummary:
    header = listing.try_header(path)
    if header is None:  # a pickle in a qtool directory: listed as it is
        return listing.pickle_file(path)
    metadata = header.metadata or {}
    notes: list[str] = []
    side, note = locate_sidecar(path, metadata)
    notes += [note] if note else []
    qinfo: dict[str, dict[str, object]] = {}
    if side.is_file():
        try:
            side_header = read_header(side)
            manifest = parse_manifest(side, side_header.metadata)
            qinfo = _qinfo(side, side_header, manifest)
            notes += _binding_notes(header, side, side_header)
        except (HeaderError, InputError, SidecarError) as err:
            notes.append(f"sidecar {side.name} unreadable: {err}")
    else:
        notes.append(f"sidecar {side.name} not found beside the file")
    shown = {k: v for k, v in metadata.items() if not k.startswith("qtool.")}
    rows = [listing.row(e, qinfo.get(e.name)) for e in header.tensors]
    return InspectSummary(str(path), "quantized", rows, shown or None, notes=notes)


def _binding_notes(header: Header, side: Path, side_header: Header) -> list[str]:
    """What dequantize will say of the pair's binding, as notes (inspect itself never refuses)."""
    metadata = header.metadata or {}
    if BINDING_KEY in metadata:
        matches = binding_digest(header.tensors, side) == metadata[BINDING_KEY]
    else:
        matches = data_digest(side, side_header) == metadata.get(DIGEST_KEY)
    if not matches:
        return [f"sidecar {side.name} does not belong to this file (binding digest mismatch)"]
    if BINDING_KEY not in metadata:
        return ["written by qtool 0.1.0: the binding covers the sidecar's data, not its manifest"]
    return []


def _qinfo(side: Path, header: Header, manifest: Manifest) -> dict[str, dict[str, object]]:
    """Per quantized tensor: scheme, dtype, axis, original dtype and the range of its scales."""
    entries = header.by_name()
    out: dict[str, dict[str, object]] = {}
    with open_regular(side) as f:
        for name, record in manifest.tensors.items():
            entry = entries.get(scale_name(name))
            info: dict[str, object] = {
                **record.spec.to_json(),
                "orig_dtype": record.orig_dtype,
                "shape": list(record.shape),
            }
            if entry is not None and entry.dtype == "F32" and entry.numel:
                f.seek(header.data_start + entry.begin)
                scales = array("f", f.read(entry.nbytes))  # numpy would cost start-up time
                if sys.byteorder == "big":
                    scales.byteswap()
                info["scale_min"], info["scale_max"] = min(scales), max(scales)
            out[name] = info
    return out
