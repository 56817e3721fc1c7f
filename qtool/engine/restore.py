"""`qtool dequantize`: quantized files (a single file, or every shard of a sharded checkpoint)
back into float checkpoints with the original names, shapes and dtypes. Every quantized input
is opened and checked (the pair belongs together, its qparams are sane) before anything is
written; tensors that were not quantized are copied byte for byte."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from qtool.engine.source import finish_directory, open_source, prepared, target_for
from qtool.errors import UsageError
from qtool.formats.ct_read import config_path, is_compressed_tensors
from qtool.formats.ct_reader import ModelReader
from qtool.formats.dense import write_dense
from qtool.formats.qtool import sidecar_path
from qtool.formats.qtool_reader import QtoolReader
from qtool.io.atomic import (
    OutputSet,
    preflight,
    refuse_file_name_for_directory,
    remove_stale_temps,
    resolve_output,
)
from qtool.io.index import check_inside
from qtool.io.safeopen import InputDir
from qtool.numerics import select
from qtool.results import DequantizedRow, DequantizeSummary

DEQUANTIZED_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def default_dequantized_path(src: Path) -> Path:
    """`model.int8.safetensors` -> `model.int8.dequantized.safetensors` beside it."""
    return src.with_name(f"{src.stem}.dequantized.safetensors")


def dequantize(
    src: Path,
    out: Path | None,
    *,
    qparams: Path | None = None,
    dtype: str = "original",
    force: bool = False,
) -> DequantizeSummary:
    """Rebuild float checkpoints: original names, shapes, dtypes; pass-throughs byte-identical.
    `qparams` names the sidecar of a single file that was moved away from it."""
    if is_compressed_tensors(src):
        if qparams is not None:
            raise UsageError(
                qparams, "a compressed-tensors model keeps its scales inside; give no sidecar"
            )
        return dequantize_model(src, out, dtype=dtype, force=force)
    source = open_source(src)
    if source.index is None:
        default = default_dequantized_path(src)
        out = resolve_output(out, default, DEQUANTIZED_SUFFIXES, "dequantize")
    else:
        refuse_file_name_for_directory(out, "dequantize")
        if qparams is not None:
            raise UsageError(
                qparams,
                "a sharded checkpoint has one sidecar per shard, found beside each shard; "
                "give no sidecar",
                hint="qparams",
            )
    target = target_for(source, out, default_dequantized_path(src), "dequantized")
    if source.index is not None:
        for shard in source.shards:
            check_inside(source.index.within, sidecar_path(shard))
    readers = _open_all(source.shards, qparams, source.within)
    try:
        select.expect(torch.device("cpu"), sum(shard.stat().st_size for shard in source.shards))
        protect = [r.sidecar_path for r in readers]
        with prepared(source, target, lambda out: [out], force, protect=protect) as notes:
            remove_stale_temps(target.directory or target.shard_outputs[0].parent)
            rows: list[DequantizedRow] = []
            with OutputSet() as outputs:
                for reader, shard_out in zip(readers, target.shard_outputs, strict=True):
                    rows += write_dense(reader, shard_out, outputs, dtype)
                finish_directory(outputs, source, target, sum(r.bytes_out for r in rows), {})
                outputs.commit()
    finally:
        for reader in readers:
            reader.close()
    return DequantizeSummary(
        inputs=[str(source.path)],
        sidecars=[str(r.sidecar_path) for r in readers],
        outputs=[str(p) for p in target.named],
        rows=rows,
        notes=notes,
    )


def dequantize_model(
    src: Path, out: Path | None, *, dtype: str = "original", force: bool = False
) -> DequantizeSummary:
    """A compressed-tensors model directory (whoever wrote it) as one float safetensors (or
    torch) file with the original names; default `<directory>.dequantized.safetensors`."""
    directory = config_path(src).parent
    named = Path(os.path.abspath(directory))  # `.` and `..` have no name to build one from
    default = named.with_name(f"{named.name}.dequantized.safetensors")
    out = resolve_output(out, default, DEQUANTIZED_SUFFIXES, "dequantize")
    reader = ModelReader(directory)
    try:
        preflight([out], [directory / "config.json", *reader.shard_paths], force=force)
        remove_stale_temps(out.parent)
        with OutputSet() as outputs:
            rows = write_dense(reader, out, outputs, dtype)
            outputs.commit()
    finally:
        reader.close()
    return DequantizeSummary(
        inputs=[str(directory)], sidecars=[], outputs=[str(out)], rows=rows, notes=[]
    )


def _open_all(
    shards: tuple[Path, ...], qparams: Path | None, within: InputDir | None
) -> list[QtoolReader]:
    readers: list[QtoolReader] = []
    try:
        for shard in shards:
            readers.append(QtoolReader(shard, qparams, within))
    except BaseException:
        for reader in readers:
            reader.close()
        raise
    return readers
