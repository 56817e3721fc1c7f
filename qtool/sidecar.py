"""The qparams sidecar: a safetensors file of `<name>.scale` / `<name>.zero_point` tensors whose
`__metadata__["qtool.qparams"]` holds a versioned JSON manifest describing every quantized tensor.

The quantized file's own metadata carries `qtool.qparams_sha256`, the SHA-256 of the sidecar's
data section, so a sidecar from another run (or another file) is recognised and refused.
Torch-free at import time: `inspect` reads manifests without loading torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qtool import __version__
from qtool.errors import SidecarError
from qtool.safeopen import open_regular
from qtool.spec import SEMANTICS, QSpec, Scheme, StorageDtype
from qtool.stformat import Header, HeaderError, strict_json

if TYPE_CHECKING:
    import torch

FORMAT = "qtool.qparams"
FORMAT_VERSION = 1
MANIFEST_KEY = "qtool.qparams"
DIGEST_KEY = "qtool.qparams_sha256"
SIDECAR_KEY = "qtool.sidecar"
SMALLEST_NORMAL = 1.1754943508222875e-38


@dataclass(frozen=True)
class Record:
    """How one tensor was quantized, enough to undo it without qtool."""

    scheme: str
    dtype: str
    axis: int | None
    qmin: int
    qmax: int
    orig_dtype: str  # safetensors dtype name of the original, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def spec(self) -> QSpec:
        return QSpec(Scheme(self.scheme), StorageDtype(self.dtype), self.axis)


@dataclass(frozen=True)
class Manifest:
    quantized_file: str
    tensors: dict[str, Record]
    semantics: str = SEMANTICS
    qtool_version: str = __version__


def sidecar_path(quantized: Path) -> Path:
    """`model.int8.safetensors` -> `model.int8.qparams.safetensors`, beside it."""
    return quantized.with_name(f"{quantized.stem}.qparams.safetensors")


def scale_name(tensor: str) -> str:
    return f"{tensor}.scale"


def zero_point_name(tensor: str) -> str:
    return f"{tensor}.zero_point"


def manifest_metadata(manifest: Manifest) -> dict[str, str]:
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "qtool_version": manifest.qtool_version,
        "semantics": manifest.semantics,
        "quantized_file": manifest.quantized_file,
        "tensors": {name: _record_json(r) for name, r in manifest.tensors.items()},
    }
    return {MANIFEST_KEY: json.dumps(doc, sort_keys=True, separators=(",", ":"))}


def _record_json(record: Record) -> dict[str, object]:
    out = asdict(record)
    out["shape"] = list(record.shape)
    return out


def parse_manifest(path: Path, metadata: dict[str, str] | None) -> Manifest:
    """The manifest of a sidecar's metadata, checked for format, version and semantics."""
    text = (metadata or {}).get(MANIFEST_KEY)
    if text is None:
        raise SidecarError(path, "not a qtool sidecar (no qtool.qparams manifest)")
    try:
        doc = strict_json(text.encode("utf-8"))
        if not isinstance(doc, dict):
            raise SidecarError(path, "damaged manifest (not a JSON object)")
        if doc.get("format") != FORMAT:
            raise SidecarError(path, f"unknown sidecar format {doc.get('format')!r}")
        version = doc.get("format_version")
        if version != FORMAT_VERSION:
            raise SidecarError(
                path,
                f"sidecar format version {version!r} is not supported (this qtool reads "
                f"version {FORMAT_VERSION}); use a matching qtool release",
            )
        if doc.get("semantics") != SEMANTICS:
            raise SidecarError(path, f"unknown semantics {doc.get('semantics')!r}")
        tensors = {name: _parse_record(path, name, r) for name, r in doc["tensors"].items()}
        return Manifest(str(doc["quantized_file"]), tensors, doc["semantics"], doc["qtool_version"])
    except SidecarError:
        raise
    except (HeaderError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise SidecarError(path, f"damaged manifest ({type(err).__name__}: {err})") from None


def _parse_record(path: Path, name: str, r: dict[str, object]) -> Record:
    axis = r["axis"]
    shape = r["shape"]
    if axis is not None and type(axis) is not int:
        raise SidecarError(path, f"axis {axis!r} is not an integer", name)
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SidecarError(path, f"shape {shape!r} is not a list of sizes", name)
    record = Record(
        scheme=str(r["scheme"]),
        dtype=str(r["dtype"]),
        axis=axis,
        qmin=int(r["qmin"]),  # type: ignore[call-overload]
        qmax=int(r["qmax"]),  # type: ignore[call-overload]
        orig_dtype=str(r["orig_dtype"]),
        shape=tuple(shape),
    )
    try:
        spec = record.spec
    except ValueError:
        raise SidecarError(
            path, f"unknown scheme/dtype {record.scheme}/{record.dtype}", name
        ) from None
    if (spec.qmin, spec.qmax) != (record.qmin, record.qmax):
        raise SidecarError(path, f"range [{record.qmin}, {record.qmax}] does not match", name)
    if axis is not None and not 0 <= axis < len(shape):
        raise SidecarError(path, f"axis {axis} out of range for shape {list(shape)}", name)
    return record


def data_digest(path: Path, header: Header) -> str:
    """SHA-256 of a safetensors file's data section (the sidecar's scales and zero points)."""
    digest = hashlib.sha256()
    with open_regular(path) as f:
        f.seek(header.data_start)
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def validate_qparams(
    path: Path, name: str, record: Record, scale: torch.Tensor, zero_point: torch.Tensor
) -> None:
    """Refuse qparams that would make dequantization meaningless (or crash a torch kernel)."""
    channels = () if record.axis is None else (record.shape[record.axis],)
    if tuple(scale.shape) != channels or tuple(zero_point.shape) != channels:
        raise SidecarError(
            path,
            f"scale/zero_point shapes {list(scale.shape)}/{list(zero_point.shape)} do not match "
            f"{list(channels)}",
            name,
        )
    if not bool(scale.isfinite().all()) or bool((scale < SMALLEST_NORMAL).any()):
        raise SidecarError(path, "scale holds zero, negative, subnormal, NaN or Inf values", name)
    if bool((zero_point < record.qmin).any()) or bool((zero_point > record.qmax).any()):
        raise SidecarError(path, f"zero_point outside [{record.qmin}, {record.qmax}]", name)
