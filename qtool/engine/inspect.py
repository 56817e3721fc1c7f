"""What is inside a checkpoint, quantized file or sidecar, read from headers (torch-free for
safetensors; a torch pickle has to be loaded, safely, to be listed)."""

from __future__ import annotations

import json
import sys
from array import array
from dataclasses import replace
from pathlib import Path

from qtool.errors import InputError, SidecarError
from qtool.formats.ct_read import (
    args_spec,
    config_path,
    is_compressed_tensors,
    model_shards,
    quantized_modules,
    read_config,
)
from qtool.formats.qtool import (
    BINDING_KEY,
    DIGEST_KEY,
    MANIFEST_KEY,
    Manifest,
    binding_digest,
    data_digest,
    is_quantized,
    locate_sidecar,
    parse_manifest,
    scale_name,
)
from qtool.io.index import INDEX_SUFFIX, check_inside, load_index
from qtool.io.safeopen import InputDir, open_regular
from qtool.io.stformat import (
    Header,
    HeaderError,
    TensorEntry,
    not_safetensors_message,
    read_header,
    read_header_file,
)
from qtool.results import InspectRow, InspectSummary, natural_key


def inspect_path(path: Path) -> InspectSummary:
    """Describe the file at `path` (a checkpoint, a quantized file, a sidecar, a sharded set),
    its tensors in natural name order (`layers.2` before `layers.10`), not in the byte layout's
    order, which groups them by dtype."""
    summary = _inspect_any(path)
    return replace(summary, rows=sorted(summary.rows, key=lambda r: natural_key(r.name)))


def _inspect_any(path: Path) -> InspectSummary:
    if is_compressed_tensors(path):
        return _inspect_compressed_tensors(path)
    if path.is_dir() or path.name.endswith(INDEX_SUFFIX):
        return _inspect_sharded(path)
    if not path.exists():
        raise InputError(path, "no such file; check the path")
    if not path.is_file():
        raise InputError(path, "not a regular file; give a checkpoint file")
    header = _try_header(path)
    if header is None:
        return _inspect_pickle(path)
    metadata = header.metadata or {}
    if MANIFEST_KEY in metadata:
        parse_manifest(path, metadata)  # validates format and version
        rows = [_row(e) for e in header.tensors]
        doc = json.loads(metadata[MANIFEST_KEY])
        return InspectSummary(str(path), "sidecar", rows, metadata=None, manifest=doc)
    if is_quantized(metadata):
        return _inspect_quantized(path, header)
    return InspectSummary(str(path), "checkpoint", [_row(e) for e in header.tensors], metadata)


def _try_header(path: Path) -> Header | None:
    """The safetensors header, or None for a torch archive or pickle (checkpoint.sniff's rule)."""
    with open_regular(path) as f:
        head = f.read(8)
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return None
    try:
        return read_header(path)
    except HeaderError as err:
        if head[:1] == b"\x80" or path.suffix in (".pt", ".pth", ".bin"):
            return None  # the pickle reader says what it is
        raise InputError(path, not_safetensors_message(path, err)) from None


def _row(entry: TensorEntry, qinfo: dict[str, object] | None = None) -> InspectRow:
    return InspectRow(entry.name, entry.dtype, entry.shape, entry.numel, entry.nbytes, qinfo)


def _inspect_quantized(path: Path, header: Header) -> InspectSummary:
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
    rows = [_row(e, qinfo.get(e.name)) for e in header.tensors]
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


def _inspect_sharded(path: Path) -> InspectSummary:
    sharded = load_index(path)
    rows: list[InspectRow] = []
    notes: list[str] = []
    quantized = False
    for shard in sharded.shards:
        check_inside(sharded.within, sharded.directory / shard)  # each read again below
        part = inspect_path(sharded.directory / shard)
        quantized |= part.kind == "quantized"
        rows += part.rows
        notes += [f"{shard}: {note}" for note in part.notes]
    kind = "sharded quantized" if quantized else "sharded"
    return InspectSummary(
        str(sharded.index), kind, rows, None, notes=notes, shards=len(sharded.shards)
    )


def _inspect_compressed_tensors(path: Path) -> InspectSummary:
    """Every stored tensor; each quantized module's scheme on its codes' row (torch-free)."""
    directory = config_path(path).parent
    within = InputDir(directory)  # config, index and shards read through one descriptor
    config = read_config(directory, within)
    headers = []
    for shard in model_shards(directory, within):
        with within.open(shard.name) as f:
            try:
                headers.append(read_header_file(f))
            except HeaderError as err:
                raise InputError(shard, f"not a valid safetensors file: {err}") from None
    entries = [e for h in headers for e in h.tensors]
    try:
        modules = quantized_modules([e.name for e in entries], config)
    except ValueError as err:
        raise InputError(config_path(path), str(err)) from None
    by_name = {e.name: e for e in entries}
    qinfo: dict[str, dict[str, object]] = {}
    for m in modules:
        codes = f"{m.module}.weight_packed"
        codes = codes if codes in by_name else f"{m.module}.weight"
        scale = by_name.get(f"{m.module}.weight_scale")
        qinfo[codes] = {
            **args_spec(m.group.weights).to_json(),
            "dtype": f"int{m.group.weights.num_bits}",
            "bits": m.group.weights.num_bits,
            "orig_dtype": scale.dtype if scale is not None else "?",
            "format": m.group.format,
        }
    rows = [_row(e, qinfo.get(e.name)) for e in entries]
    return InspectSummary(
        str(directory), "compressed-tensors", rows, headers[0].metadata, shards=len(headers),
        quantized_modules=len(modules), ignore=list(config.ignore),
    )  # fmt: skip


def _inspect_pickle(path: Path) -> InspectSummary:
    from qtool.io.checkpoint import open_checkpoint  # imports torch: only pickles pay for it

    ckpt = open_checkpoint(path)
    try:
        rows = [_row(e) for e in ckpt.entries]
        notes = [f"skipped non-tensor entries: {', '.join(ckpt.skipped)}"] if ckpt.skipped else []
        return InspectSummary(str(path), "checkpoint", rows, None, notes=notes)
    finally:
        ckpt.close()
