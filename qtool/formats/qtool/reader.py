"""Reading the qtool format: a quantized file opened with its sidecar, the pair checked to
belong together, and every tensor given back as float values (dequantized on the fly). The one
place that dequantizes through a sidecar: dequantize, compare and plots all read through it."""

from __future__ import annotations

import contextlib
import glob
import re
from pathlib import Path

import torch

from qtool.dtypes import RESTORE_DTYPES
from qtool.errors import InputError, NumericError, SidecarError
from qtool.formats.dense.reader import DenseReader
from qtool.formats.detect import HeaderView, quantized_format
from qtool.formats.qtool.manifest import (
    BINDING_KEY,
    DIGEST_KEY,
    MANIFEST_KEY,
    Manifest,
    Record,
    binding_digest,
    data_digest,
    grid_reach,
    is_quantized,
    locate_sidecar,
    parse_manifest,
    scale_name,
    validate_qparams,
    zero_point_name,
)
from qtool.io.checkpoint import ST_TO_TORCH, TORCH_TO_ST, Checkpoint, open_checkpoint
from qtool.io.safeopen import InputDir
from qtool.io.stformat import Header, TensorEntry
from qtool.numerics import kernels
from qtool.spec import QSpec, packed_shape


def _not_quantized(src: Path, ckpt: Checkpoint) -> InputError:
    """What a file read as qtool-quantized, without qtool's metadata, is instead."""
    names = [e.name for e in ckpt.entries]
    found = quantized_format(HeaderView(src, ckpt.metadata or {}, names))
    if found is not None:  # a shard of a compressed-tensors model directory
        return InputError(src, f"is {found}; pass its model directory ({src.parent}) instead")
    return InputError(
        src,
        "not a quantized file: a float checkpoint (no qtool quantization in its metadata), so "
        "there is nothing to dequantize; give a file written by qtool quantize or a "
        "compressed-tensors model directory (qtool inspect shows what a file holds)",
    )


class QtoolReader(DenseReader):
    """A quantized file and its validated sidecar, read as float tensors (tensors that were not
    quantized read as in any checkpoint)."""

    def __init__(
        self, src: Path, qparams: Path | None = None, within: InputDir | None = None
    ) -> None:
        """`within`: the checkpoint directory `src` and its sidecar lie in, held open (a shard
        of a sharded set): both are opened through it, never through a link leading out."""
        self.path = src
        ckpt = open_checkpoint(src, within)
        _refuse_sidecar_as_input(src, ckpt)
        self.sidecar_path = qparams or locate_sidecar(src, ckpt.metadata)[0]
        side_within = within if qparams is None else None
        exists = (
            side_within.exists(self.sidecar_path.name)
            if side_within is not None
            else self.sidecar_path.exists()
        )
        if not exists:
            ckpt.close()
            if qparams is None and not is_quantized(ckpt.metadata):
                raise _not_quantized(src, ckpt)
            raise SidecarError(
                self.sidecar_path,
                f"no qparams sidecar for {src.name}; name it if it was moved",
                hint="qparams",
            )
        sidecar = None
        try:
            sidecar = open_checkpoint(self.sidecar_path, side_within)
            self.manifest: Manifest = parse_manifest(self.sidecar_path, sidecar.metadata)
            _check_binding(src, ckpt, self.sidecar_path, sidecar)
            _check_pair(src, ckpt, self.sidecar_path, sidecar, self.manifest)
        except Exception:
            ckpt.close()
            if sidecar is not None:
                sidecar.close()
            raise
        super().__init__(src, ckpt)
        self.sidecar = sidecar
        self._side_entries = sidecar.by_name()

    def entry(self, name: str) -> TensorEntry:
        """The tensor as stored in the quantized file (codes for a quantized tensor)."""
        return self._entries[name]

    def record(self, name: str) -> Record | None:
        return self.manifest.tensors.get(name)

    def quantization(self, name: str) -> QSpec | None:
        record = self.record(name)
        return record.spec if record is not None else None

    def shape(self, name: str) -> tuple[int, ...]:
        record = self.record(name)
        return record.shape if record is not None else self._entries[name].shape

    def dtype(self, name: str) -> str:
        record = self.record(name)
        return record.orig_dtype if record is not None else self._entries[name].dtype

    def values(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        record = self.record(name)
        entry = self._entries[name]
        if record is None:
            return super().values(name, dtype)
        scale = self.sidecar.tensor(self._side_entries[scale_name(name)])
        zero_point = self.sidecar.tensor(self._side_entries[zero_point_name(name)])
        target = dtype or ST_TO_TORCH[record.orig_dtype]
        out = kernels.dequantize_chosen(
            self.ckpt.tensor(entry), scale, zero_point, record.spec, target, record.shape
        )
        # Cheap test first (the grid's extreme in the target dtype), then the exact one.
        fits = bool(grid_reach(record, scale, zero_point).to(target).isfinite())
        if not fits and not bool(out.isfinite().all()):
            raise NumericError(
                self.path,
                f"dequantized values overflow {TORCH_TO_ST[target]} to infinity; "
                "restore this checkpoint as float32 (or bfloat16)",
                name,
                hint="restore-dtype",
            )
        return out

    @property
    def sidecars(self) -> list[Path]:
        return [self.sidecar_path]

    def close(self) -> None:
        super().close()
        self.sidecar.close()


def _refuse_sidecar_as_input(src: Path, ckpt: Checkpoint) -> None:
    """A sidecar given where the quantized file belongs: name the file to pass instead."""
    if MANIFEST_KEY not in (ckpt.metadata or {}):
        return
    ckpt.close()
    quantized = parse_manifest(src, ckpt.metadata).quantized_file
    raise SidecarError(
        src, f"this is a qparams sidecar; pass the quantized file it belongs to ({quantized})"
    )


def _check_binding(src: Path, ckpt: Checkpoint, side_path: Path, sidecar: Checkpoint) -> None:
    """Refuse a pair whose binding digest does not match (the sidecar read through the one
    descriptor it was opened with); files of qtool 0.1.0 carry only the legacy digest of the
    sidecar's data, which is checked instead."""
    metadata = ckpt.metadata or {}
    fd = sidecar.descriptor
    if BINDING_KEY in metadata:
        expected, actual = metadata[BINDING_KEY], binding_digest(ckpt.entries, side_path, fd)
    elif DIGEST_KEY in metadata:
        header = Header(sidecar.entries, sidecar.metadata, sidecar.data_start)
        expected, actual = metadata[DIGEST_KEY], data_digest(side_path, header, fd)
    else:
        raise SidecarError(src, "not a qtool-quantized file (no qparams digest in its metadata)")
    if actual != expected:
        raise SidecarError(
            side_path,
            f"does not belong to {src.name} (binding digest mismatch: from another run or "
            "file, or one of the two was edited); re-run quantize to produce a matching pair"
            + _kept_hint(side_path),
        )


_KEPT = re.compile(r"\.qtool-kept-\d{8}T\d{6}Z(-[0-9a-f]{8})?")


def _kept_hint(side_path: Path) -> str:
    """Where a sidecar that a killed `--force` run replaced was kept (io/commit.keep_as_kept),
    if any: the newest such name beside it owned by the sidecar's owner (not a name another
    user planted in a shared directory)."""
    with contextlib.suppress(OSError):
        owner = side_path.stat().st_uid
        kept = sorted(
            p.name
            for p in side_path.parent.glob(glob.escape(side_path.name) + ".qtool-kept-*")
            if _KEPT.fullmatch(p.name, len(side_path.name)) and p.lstat().st_uid == owner
        )
        if kept:
            return (f", or, if {kept[-1]} beside it is the sidecar a killed --force run "
                    f"replaced, move it back to {side_path.name}")  # fmt: skip
    return ""


def _check_pair(
    src: Path, ckpt: Checkpoint, side_path: Path, sidecar: Checkpoint, manifest: Manifest
) -> None:
    entries, side_entries = ckpt.by_name(), sidecar.by_name()
    for name, record in manifest.tensors.items():
        entry = entries.get(name)
        if entry is None:
            raise SidecarError(side_path, f"describes a tensor missing from {src.name}", name)
        stored = packed_shape(record.shape) if record.spec.dtype.packed else record.shape
        if entry.dtype != record.spec.dtype.safetensors_dtype or entry.shape != stored:
            raise SidecarError(
                side_path,
                f"says {record.spec.dtype.value} {list(record.shape)} but {src.name} holds "
                f"{entry.dtype} {list(entry.shape)}",
                name,
            )
        if record.orig_dtype not in RESTORE_DTYPES.values() and record.orig_dtype != "F64":
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
