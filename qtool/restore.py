"""Turning quantized files back into float checkpoints: open a quantized file with its
sidecar (checking that the two belong together), dequantize, and write the original names,
shapes and dtypes; pass-through tensors are copied byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qtool import kernels
from qtool.atomic import OutputSet, describe_os_error, remove_stale_temps
from qtool.checkpoint import (
    ST_TO_TORCH,
    TORCH_TO_ST,
    Checkpoint,
    StreamingWriter,
    open_checkpoint,
    tensor_bytes,
)
from qtool.errors import OutputError, SidecarError
from qtool.index import is_sharded
from qtool.pipeline import carried_metadata, check_output
from qtool.sidecar import (
    DIGEST_KEY,
    Manifest,
    Record,
    data_digest,
    parse_manifest,
    scale_name,
    sidecar_path,
    validate_qparams,
    zero_point_name,
)
from qtool.stformat import build_header, read_header
from qtool.summary import DequantizedRow, DequantizeSummary

OUTPUT_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def default_dequantized_path(src: Path) -> Path:
    """`model.int8.safetensors` -> `model.int8.dequantized.safetensors` beside it."""
    return src.with_name(f"{src.stem}.dequantized.safetensors")


def dequantize_path(
    src: Path,
    out: Path | None,
    *,
    qparams: Path | None = None,
    dtype: str = "original",
    force: bool = False,
) -> DequantizeSummary:
    """Dequantize a quantized file, or a quantized sharded checkpoint."""
    from qtool import sharded  # sharded imports this module

    if is_sharded(src):
        return sharded.dequantize_sharded(src, out, dtype=dtype, force=force)
    return dequantize_file(src, out, qparams=qparams, dtype=dtype, force=force)


@dataclass(frozen=True)
class QuantizedPair:
    """A quantized file opened together with its validated sidecar."""

    ckpt: Checkpoint
    sidecar: Checkpoint
    manifest: Manifest

    def close(self) -> None:
        self.ckpt.close()
        self.sidecar.close()


def open_quantized(src: Path, qparams: Path | None = None) -> QuantizedPair:
    """Open a quantized file and its sidecar; refuse a pair that does not belong together."""
    ckpt = open_checkpoint(src)
    side_path = qparams or sidecar_path(src)
    if not side_path.exists():
        ckpt.close()
        raise SidecarError(
            side_path, f"no qparams sidecar for {src.name}; pass --qparams PATH if it was moved"
        )
    sidecar = open_checkpoint(side_path)
    try:
        manifest = parse_manifest(side_path, sidecar.metadata)
        _check_binding(src, ckpt, side_path, sidecar)
        _check_pair(src, ckpt, side_path, sidecar, manifest)
    except Exception:
        ckpt.close()
        sidecar.close()
        raise
    return QuantizedPair(ckpt, sidecar, manifest)


def _check_binding(src: Path, ckpt: Checkpoint, side_path: Path, sidecar: Checkpoint) -> None:
    expected = (ckpt.metadata or {}).get(DIGEST_KEY)
    if expected is None:
        raise SidecarError(src, "not a qtool-quantized file (no qparams digest in its metadata)")
    if data_digest(side_path, read_header(side_path)) != expected:
        raise SidecarError(
            side_path,
            f"does not belong to {src.name} (digest mismatch: from another run or file); "
            "re-run quantize to produce a matching pair",
        )


def _check_pair(
    src: Path, ckpt: Checkpoint, side_path: Path, sidecar: Checkpoint, manifest: Manifest
) -> None:
    entries, side_entries = ckpt.by_name(), sidecar.by_name()
    for name, record in manifest.tensors.items():
        entry = entries.get(name)
        if entry is None:
            raise SidecarError(side_path, f"describes a tensor missing from {src.name}", name)
        if entry.dtype != record.spec.dtype.safetensors_dtype or entry.shape != record.shape:
            raise SidecarError(
                side_path,
                f"says {record.dtype} {list(record.shape)} but {src.name} holds "
                f"{entry.dtype} {list(entry.shape)}",
                name,
            )
        if record.orig_dtype not in OUTPUT_DTYPES.values() and record.orig_dtype != "F64":
            raise SidecarError(side_path, f"unknown original dtype {record.orig_dtype}", name)
        for key in (scale_name(name), zero_point_name(name)):
            if key not in side_entries:
                raise SidecarError(side_path, f"tensor {key!r} is missing", name)
        validate_qparams(
            side_path,
            name,
            record,
            sidecar.tensor(side_entries[scale_name(name)]),
            sidecar.tensor(side_entries[zero_point_name(name)]),
        )


def dequantize_file(
    src: Path,
    out: Path | None,
    *,
    qparams: Path | None = None,
    dtype: str = "original",
    force: bool = False,
) -> DequantizeSummary:
    """Rebuild a float checkpoint: original names, shapes, dtypes; pass-throughs byte-identical."""
    out = out or default_dequantized_path(src)
    pair = open_quantized(src, qparams)
    try:
        check_output(out, [src, qparams or sidecar_path(src)], force)
        remove_stale_temps(out.parent)
        with OutputSet() as outputs:
            if out.suffix in (".pt", ".pth", ".bin"):
                rows = _write_dequantized_pt(pair, out, outputs, dtype)
            else:
                rows = write_dequantized(pair, out, outputs, dtype)
            outputs.commit()
    finally:
        pair.close()
    return DequantizeSummary(
        inputs=[str(src)],
        sidecars=[str(qparams or sidecar_path(src))],
        outputs=[str(out)],
        rows=rows,
    )


def _restored_dtype(record: Record, dtype: str) -> str:
    return record.orig_dtype if dtype == "original" else OUTPUT_DTYPES[dtype]


def _dequantize_one(pair: QuantizedPair, name: str, dtype: str) -> torch.Tensor:
    record = pair.manifest.tensors[name]
    side = pair.sidecar.by_name()
    return kernels.dequantize(
        pair.ckpt.tensor(pair.ckpt.by_name()[name]),
        pair.sidecar.tensor(side[scale_name(name)]),
        pair.sidecar.tensor(side[zero_point_name(name)]),
        record.axis,
        ST_TO_TORCH[_restored_dtype(record, dtype)],
    )


def write_dequantized(
    pair: QuantizedPair, out: Path, outputs: OutputSet, dtype: str
) -> list[DequantizedRow]:
    records = pair.manifest.tensors
    specs = []
    for e in pair.ckpt.entries:
        out_dtype = _restored_dtype(records[e.name], dtype) if e.name in records else e.dtype
        specs.append((e.name, out_dtype, e.shape))
    header_bytes, header = build_header(specs, carried_metadata(pair.ckpt.metadata) or None)
    writer = StreamingWriter(outputs.create(out), header_bytes, header, out)
    entries = pair.ckpt.by_name()
    rows: dict[str, DequantizedRow] = {}
    for entry in header.tensors:
        if entry.name in records:
            data = tensor_bytes(_dequantize_one(pair, entry.name, dtype))
        else:
            data = pair.ckpt.raw(entries[entry.name])
        writer.write(entry.name, data)
        rows[entry.name] = DequantizedRow(
            entry.name, entry.shape, entry.dtype, entry.name in records, entry.nbytes
        )
    writer.finish()
    pair.ckpt.check_unchanged()
    return [rows[e.name] for e in pair.ckpt.entries]


def _write_dequantized_pt(
    pair: QuantizedPair, out: Path, outputs: OutputSet, dtype: str
) -> list[DequantizedRow]:
    """torch.save needs the whole state dict in memory; .safetensors output streams instead."""
    records = pair.manifest.tensors
    state: dict[str, torch.Tensor] = {}
    rows = []
    for e in pair.ckpt.entries:
        if e.name in records:
            t = _dequantize_one(pair, e.name, dtype)
        else:
            t = pair.ckpt.tensor(e).clone()
        state[e.name] = t
        rows.append(
            DequantizedRow(e.name, e.shape, TORCH_TO_ST[t.dtype], e.name in records, t.nbytes)
        )
    try:
        torch.save(state, outputs.create(out))
    except OSError as err:
        raise OutputError(out, f"cannot write: {describe_os_error(err)}") from None
    except RuntimeError as err:  # torch's zip writer reports a failed write as an "enforce fail"
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise OutputError(
            out,
            f"cannot write: torch.save failed ({first}), typically a full disk or a file size "
            "limit; free some space or write elsewhere with -o",
        ) from None
    return rows
