"""Writing the qtool format: the quantized file (every tensor under its own name, codes as
I8/U8, 4-bit packed) streamed tensor by tensor, then its qparams sidecar, then the quantized
file's header again with the digest that binds the two (manifest.py has the names).

Torch-free at import (torch comes with the first tensor written): a dry run plans with this
format without loading torch."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from qtool import calibration
from qtool.errors import OutputError
from qtool.formats.base import FormatContext, OutputFormat, Planned, carried_metadata
from qtool.formats.qtool import config as model_config
from qtool.formats.qtool.manifest import (
    BINDING_KEY,
    DIGEST_KEY,
    SIDECAR_KEY,
    Manifest,
    Record,
    choice_name,
    manifest_metadata,
    scale_name,
    sidecar_path,
    tensor_table,
    zero_point_name,
)
from qtool.io.atomic import OutputSet
from qtool.io.jsonfile import read_json_object
from qtool.io.stformat import TensorEntry, build_header
from qtool.io.writer import StreamingWriter
from qtool.spec import Codec, FormatName, as_grid

IMATRIX_KEY = "qtool.imatrix"  # the sidecar's record of --imatrix (engine/importance.py)
TEXTS_KEY = f"qtool.{calibration.TEXTS_KEY}"  # the texts a method or an imatrix used

if TYPE_CHECKING:
    import torch

    from qtool.numerics.kernels import QuantizedTensor

_PLACEHOLDER_DIGEST = "0" * 64


def stored_dtype_shape(entry: TensorEntry, spec: Codec | None) -> tuple[str, tuple[int, ...]]:
    """How a tensor is stored in the quantized file: as it is, or its (packed) codes."""
    if spec is None:
        return entry.dtype, entry.shape
    shape, dtype, _ = spec.code_layout(entry.shape)
    return dtype, shape


def _patch_digests(header_bytes: bytes, digests: dict[str, str]) -> bytes:
    """The header with its placeholder digests filled in (same length; no second build, which
    costs seconds for 50k tensors). Each `"key":"000..."` occurs once, in the metadata: quotes
    inside JSON strings are escaped, so no tensor name can contain it."""
    for key, digest in digests.items():
        placeholder = f'"{key}":"{_PLACEHOLDER_DIGEST}"'.encode()
        if header_bytes.count(placeholder) != 1:
            raise AssertionError(f"header must hold one {key} placeholder")
        header_bytes = header_bytes.replace(placeholder, f'"{key}":"{digest}"'.encode())
    return header_bytes


class QtoolFormat(OutputFormat):
    """qtool's own format: codes under the original names, and a sidecar of qparams; every
    spec (granularity, storage dtype, range method) and the rules' plan as it stands."""

    name = FormatName.QTOOL.value
    keeps_tied_embedding = True

    def __init__(self, context: FormatContext | None = None) -> None:
        self._context = context or FormatContext()

    def directory_files(self, planned: Sequence[Planned]) -> dict[str, bytes]:
        """The model's config.json marked as qtool codes (formats/qtool/config.py), so that no
        float loader takes the directory for a float model; nothing when there is none."""
        path, within = self._context.config, self._context.config_dir
        if path is None or (within is not None and not within.exists(path.name)):
            return {}
        doc = read_json_object(path, within=within, what="model config")
        return {"config.json": model_config.config_bytes(model_config.marked(doc))}

    def layout(self, out: Path) -> list[Path]:
        """The quantized file and its sidecar; OutputError for a name that is not UTF-8 (the
        quantized file records its own and its sidecar's names in its UTF-8 metadata)."""
        try:
            out.name.encode("utf-8")
        except UnicodeEncodeError:
            raise OutputError(
                out,
                "the output name is not valid UTF-8 and cannot be recorded in the file's "
                "metadata; choose a UTF-8 name with -o",
            ) from None
        return [out, sidecar_path(out)]

    def index_section(self, outputs: Sequence[Path]) -> dict[str, object]:
        """The sidecar of every shard, so that the index says which belongs to which."""
        sidecars = {out.name: sidecar_path(out).name for out in outputs}
        return {"format": "qtool.sharded", "format_version": 1, "sidecars": sidecars}

    def writer(
        self,
        planned: Sequence[Planned],
        metadata: dict[str, str] | None,
        out: Path,
        outputs: OutputSet,
    ) -> QtoolShardWriter:
        return QtoolShardWriter(planned, metadata, out, outputs, self._context.imatrix, self.texts)


class QtoolShardWriter:
    """One quantized file and its sidecar. The quantized file is written in its header's order
    (the reference writer's), its header rewritten at the end with the sidecar's digest."""

    def __init__(
        self,
        planned: Sequence[Planned],
        metadata: dict[str, str] | None,
        out: Path,
        outputs: OutputSet,
        imatrix: Mapping[str, object] | None = None,
        texts: Sequence[calibration.TextUse] = (),
    ) -> None:
        self._out, self._outputs = out, outputs
        self._imatrix = imatrix  # --imatrix's provenance, kept in the sidecar (IMATRIX_KEY)
        self._texts = tuple(texts)  # kept in the sidecar (TEXTS_KEY) when there are any
        self._side = sidecar_path(out)
        self._metadata = carried_metadata(metadata) | {SIDECAR_KEY: self._side.name}
        self._specs = [(p.entry.name, *stored_dtype_shape(p.entry, p.spec)) for p in planned]
        self._planned = {p.entry.name: p for p in planned}
        metadata = self._metadata | dict.fromkeys((DIGEST_KEY, BINDING_KEY), _PLACEHOLDER_DIGEST)
        self._header_bytes, header = build_header(self._specs, metadata)
        self._table = header.tensors
        self._writer = StreamingWriter(
            outputs.create(out, last=True), self._header_bytes, header, out
        )
        self.order = [self._planned[e.name].entry for e in header.tensors]
        self._qparams: dict[str, dict[str, torch.Tensor]] = {}
        self._methods: dict[str, str] = {}

    def keep(self, entry: TensorEntry, data: memoryview) -> None:
        self._writer.write(entry.name, data)

    def quantized(self, entry: TensorEntry, spec: Codec, result: QuantizedTensor) -> None:
        from qtool.io.checkpoint import tensor_bytes

        self._writer.write(entry.name, tensor_bytes(result.q.cpu()))
        parts = {
            scale_name(entry.name): result.scale,
            zero_point_name(entry.name): result.zero_point,
        }
        if result.choice is not None:
            parts[choice_name(entry.name)] = result.choice
        self._qparams[entry.name] = {key: t.cpu() for key, t in parts.items()}
        if result.method is not None:
            self._methods[entry.name] = result.method

    def finish(self) -> None:
        digests = self._write_sidecar()
        self._writer.finish(_patch_digests(self._header_bytes, digests))

    def _write_sidecar(self) -> dict[str, str]:
        """Write the sidecar; return the quantized file's binding digests: BINDING_KEY over its
        tensor table and the whole sidecar, DIGEST_KEY (qtool 0.1.0's) over the sidecar's data."""
        from qtool.io.checkpoint import TORCH_TO_ST, tensor_bytes

        records = {name: self._record(name) for name in sorted(self._qparams)}
        tensors = {key: t for parts in self._qparams.values() for key, t in parts.items()}
        metadata = manifest_metadata(Manifest(self._out.name, records))
        if self._imatrix is not None:
            metadata[IMATRIX_KEY] = json.dumps(dict(self._imatrix), sort_keys=True)
        if self._texts:
            metadata[TEXTS_KEY] = json.dumps(calibration.texts_json(self._texts), sort_keys=True)
        specs = [(n, TORCH_TO_ST[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
        header_bytes, header = build_header(specs, metadata)
        side = self._side
        writer = StreamingWriter(self._outputs.create(side), header_bytes, header, side)
        digest = hashlib.sha256()
        binding = hashlib.sha256(tensor_table(self._table) + header_bytes)
        for entry in header.tensors:
            data = tensor_bytes(tensors[entry.name])
            digest.update(data)
            binding.update(data)
            writer.write(entry.name, data)
        writer.finish()
        return {DIGEST_KEY: digest.hexdigest(), BINDING_KEY: binding.hexdigest()}

    def _record(self, name: str) -> Record:
        from qtool.numerics.range_methods import search_candidates

        planned = self._planned[name]
        assert planned.spec is not None
        spec = as_grid(planned.spec)  # the registry lets only grids reach this format
        candidates = search_candidates(spec, planned.entry.shape)
        method = self._methods.get(name)
        return Record(spec, planned.entry.dtype, planned.entry.shape, candidates, method)
