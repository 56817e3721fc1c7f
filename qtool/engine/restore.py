"""`qtool dequantize`: any quantized checkpoint `detect` recognises (a qtool file, a directory of
them, a compressed-tensors model directory) back into float tensors with the original names,
shapes and dtypes. Every quantized input is opened and checked (a qtool pair belongs together,
every scale is sane) before anything is written; tensors that were not quantized are copied
byte for byte.

A file gives a file; a directory gives a float model directory that mirrors it (one file per
weight file, the config without its quantization_config, the companions, the index), unless
`-o` names one .safetensors/.pt file, which then holds every tensor."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from qtool.engine.layout import (
    Placement,
    Target,
    default_directory,
    directory_target,
    file_target,
    finish_directory,
    prepared,
)
from qtool.engine.source import Source
from qtool.engine.threads import using_threads
from qtool.errors import InputError, UsageError
from qtool.formats.base import FloatReader
from qtool.formats.detect import detect
from qtool.formats.registry import FormatEntry, entry, open_reader, write_float
from qtool.io.atomic import OutputSet, resolve_output
from qtool.numerics import select
from qtool.results import DequantizedRow, DequantizeSummary, Progress
from qtool.spec import FormatName

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
    progress: Progress | None = None,
) -> DequantizeSummary:
    """Rebuild float checkpoints: original names, shapes, dtypes; pass-throughs byte-identical.
    `qparams` names the sidecar of a single file that was moved away from it. `progress` gets
    the input's bytes, tensor by tensor as each is read."""
    found = detect(src)
    if qparams is not None and found.directory is not None and found.quantized:
        raise UsageError(qparams, f"{_scales_inside(found.format)}; give no sidecar")
    lone_file = qparams is None or found.directory is not None  # a sidecar makes a file quantized
    if not found.quantized and lone_file and not entry(found.format).dequantize_float:
        raise InputError(
            src,
            f"not a quantized file: a float checkpoint ({found.description}), so there is "
            "nothing to dequantize; give what qtool quantize wrote or a compressed-tensors "
            "model directory (qtool inspect shows what a file holds)",
        )
    source = Source(found)
    target = _target(source, src, out, entry(found.format))
    reader = open_reader(found, qparams)
    try:
        select.expect(torch.device("cpu"), sum(shard.stat().st_size for shard in source.shards))
        with (
            prepared(source, target, lambda o: [o], force, protect=reader.sidecars) as place,
            using_threads(None),  # the idle cores (engine/threads.py)
        ):
            rows = _write(_reported(reader, progress), source, place, dtype)
    finally:
        reader.close()
    return DequantizeSummary(
        inputs=[str(source.path)],
        sidecars=[str(s) for s in reader.sidecars],
        outputs=[str(p) for p in target.named],
        rows=rows,
        notes=place.notes,
    )


def _scales_inside(fmt: str) -> str:
    """Where a quantized directory of the format `fmt` keeps its scales, instead of a sidecar."""
    if fmt == FormatName.QTOOL.value:
        return "a qtool-quantized directory has one sidecar per shard, found beside each shard"
    if fmt == FormatName.COMPRESSED_TENSORS.value:
        return "a compressed-tensors model keeps its scales inside"
    return f"a {fmt} model directory keeps its scales inside"


def _target(source: Source, src: Path, out: Path | None, fmt: FormatEntry) -> Target:
    """A file for a file (`-o`, or beside it; a file of the input's own format where it writes
    float ones: a GGUF's float GGUF); for a directory, the directory `-o` names (or
    `<dir>.dequantized/`), or the one file it names."""
    if source.directory is None:
        default = default_dequantized_path(src)
        own = (fmt.suffix,) if fmt.float_output is not None else ()
        accepted = (*DEQUANTIZED_SUFFIXES, *own)
        return file_target(resolve_output(out, default, accepted, "dequantize"))
    if out is not None and out.suffix.lower() in DEQUANTIZED_SUFFIXES and not out.is_dir():
        return file_target(out)
    return directory_target(source, out or default_directory(source, "dequantized"))


def _reported(reader: FloatReader, progress: Progress | None) -> FloatReader:
    """`reader`, whose reads now move `progress`: a tensor's stored bytes once it is read
    (dequantized or copied), the costly part of writing it. Its own methods are wrapped on the
    instance (this run opened it and closes it), so a writer that needs the reader's own class
    (a float GGUF) still gets it."""
    if progress is None:
        return reader
    progress.start(sum(reader.nbytes(n) for n in reader.names))
    for method in ("values", "raw"):
        setattr(reader, method, _reporting(getattr(reader, method), reader, progress))
    if hasattr(reader, "slabs"):  # a GGUF reader's tensors a slab at a time (float GGUF output)
        reader.slabs = _reporting_slabs(reader.slabs, reader, progress)
    return reader


def _reporting(read: Callable[..., Any], reader: FloatReader, progress: Progress) -> Any:
    def reported(name: str, *args: Any, **kwargs: Any) -> Any:
        progress.advance(name, 0)
        found = read(name, *args, **kwargs)
        progress.advance(name, reader.nbytes(name))
        return found

    return reported


def _reporting_slabs(read: Callable[..., Any], reader: FloatReader, progress: Progress) -> Any:
    def reported(name: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        progress.advance(name, 0)
        yield from read(name, *args, **kwargs)
        progress.advance(name, reader.nbytes(name))

    return reported


def _write(
    reader: FloatReader, source: Source, place: Placement, dtype: str
) -> list[DequantizedRow]:
    """Every tensor into its output (a directory: the file mirroring the one that held it),
    then a directory's own files; committed only when all is written."""
    target = place.target
    rows: list[DequantizedRow] = []
    weight_map: dict[str, str] = {}
    with OutputSet() as outputs:
        for out, names in _per_output(reader, source, target):
            rows += write_float(reader, out, outputs, dtype, names, source.found.format)
            weight_map |= dict.fromkeys(names, out.name)
        total = sum(r.bytes_out for r in rows)
        files = _with_dtype(reader.restored_files(), source.found.config, dtype)
        finish_directory(outputs, source, place, files, weight_map, total)
        outputs.commit()
    by_name = {r.name: r for r in rows}
    return [by_name[n] for n in reader.names]


def _with_dtype(files: dict[str, bytes], config: object, dtype: str) -> dict[str, bytes]:
    """The float directory's config.json saying the dtype every float tensor was written in
    (`--to`), so that transformers does not cast them back: its `dtype`/`torch_dtype` (the
    ones it has, else `dtype`), also in a `text_config`. `config`: the input's, parsed."""
    if dtype == "original":
        return files
    doc = json.loads(files["config.json"]) if "config.json" in files else config
    if not isinstance(doc, dict):
        return files
    doc = _set_dtype(doc, dtype)
    text = doc.get("text_config")
    if isinstance(text, dict) and (_DTYPE_KEYS & text.keys()):
        doc["text_config"] = _set_dtype(text, dtype)
    data = (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()
    return files | {"config.json": data}


_DTYPE_KEYS = {"dtype", "torch_dtype"}


def _set_dtype(doc: dict[str, object], dtype: str) -> dict[str, object]:
    keys = _DTYPE_KEYS & doc.keys() or {"dtype"}
    return doc | dict.fromkeys(sorted(keys), dtype)


def _per_output(
    reader: FloatReader, source: Source, target: Target
) -> Iterator[tuple[Path, list[str]]]:
    """Each output file with the names it holds, in the order of the input's files."""
    if target.directory is None:
        yield target.shard_outputs[0], reader.names
        return
    held: dict[str, list[str]] = {}
    for name in reader.names:
        held.setdefault(reader.file_of(name).name, []).append(name)
    for shard, out in zip(source.shards, target.shard_outputs, strict=True):
        if shard.name in held:
            yield out, held[shard.name]
