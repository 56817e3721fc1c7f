"""The qparams sidecar: a safetensors file of `<name>.scale` / `<name>.zero_point` tensors whose
`__metadata__["qtool.qparams"]` holds a versioned JSON manifest describing every quantized tensor.

The quantized file's own metadata carries `qtool.binding_sha256`, the SHA-256 of its own tensor
table followed by the whole sidecar file (header, manifest and data), so a sidecar from another
run, or an edit of either file's header or of the sidecar, is recognised and refused. It also
carries `qtool.qparams_sha256` (the sidecar's data section only), the binding of qtool 0.1.0
files, which older releases check and which this one still accepts alone, for those files.
Torch-free at import time: `inspect` reads manifests without loading torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qtool import __version__
from qtool.errors import SidecarError
from qtool.io.safeopen import open_regular
from qtool.io.stformat import Header, HeaderError, TensorEntry, strict_json
from qtool.spec import (
    MSE_ALGORITHM,
    SEMANTICS,
    Granularity,
    PerChannel,
    PerGroup,
    PerTensor,
    QSpec,
    RangeMethod,
    Scheme,
    StorageDtype,
    granularity_from_json,
    granularity_json,
    qparam_shape,
)

if TYPE_CHECKING:
    import torch

FORMAT = "qtool.qparams"
FORMAT_VERSION = 2  # the newest this qtool writes and reads
V1_DTYPES = ("int8", "uint8")
MANIFEST_KEY = "qtool.qparams"
DIGEST_KEY = "qtool.qparams_sha256"  # legacy binding: the sidecar's data section only
BINDING_KEY = "qtool.binding_sha256"  # tensor table of the quantized file + the whole sidecar
SIDECAR_KEY = "qtool.sidecar"
SMALLEST_NORMAL = 1.1754943508222875e-38


@dataclass(frozen=True)
class Record:
    """How one tensor was quantized, enough to undo it without qtool."""

    spec: QSpec
    orig_dtype: str  # safetensors dtype name of the original, e.g. "BF16"
    shape: tuple[int, ...]
    candidates: tuple[float, ...] = ()  # --range mse: the multipliers tried, in order
    method: str | None = None  # a calibrated method chose the codes (gptq); None: rounding

    @property
    def fits_v1(self) -> bool:
        """Whether a version-1 reader understands this record (8-bit, tensor/channel, minmax)."""
        s = self.spec
        return (
            s.dtype.value in V1_DTYPES
            and not isinstance(s.granularity, PerGroup)
            and s.range_method is RangeMethod.MINMAX
        )


@dataclass(frozen=True)
class Manifest:
    quantized_file: str
    tensors: dict[str, Record]
    semantics: str = SEMANTICS
    qtool_version: str = __version__


def locate_sidecar(quantized: Path, metadata: dict[str, str] | None) -> tuple[Path, str | None]:
    """The sidecar of a quantized file: the name its metadata records (so a renamed quantized
    file still finds its sidecar), else the default name; and a note when the recorded name is
    not a plain file name beside it (then ignored)."""
    named = (metadata or {}).get(SIDECAR_KEY)
    if named is None:
        return sidecar_path(quantized), None
    if named in ("", ".", "..") or any(c in named for c in "/\\\0"):
        note = f"sidecar name {named!r} in the metadata is not a plain file name; ignored"
        return sidecar_path(quantized), note
    return quantized.with_name(named), None


def sidecar_path(quantized: Path) -> Path:
    """`model.int8.safetensors` -> `model.int8.qparams.safetensors`, beside it."""
    return quantized.with_name(f"{quantized.stem}.qparams.safetensors")


def scale_name(tensor: str) -> str:
    return f"{tensor}.scale"


def zero_point_name(tensor: str) -> str:
    return f"{tensor}.zero_point"


def choice_name(tensor: str) -> str:
    """The candidate the mse range search chose for every group (U8, the scale's shape)."""
    return f"{tensor}.range_choice"


def format_version(manifest: Manifest) -> int:
    """1 when every record is readable by a version-1 reader, else 2 (docs/formats.md)."""
    return 1 if all(r.fits_v1 for r in manifest.tensors.values()) else 2


def manifest_metadata(manifest: Manifest) -> dict[str, str]:
    version = format_version(manifest)
    doc = {
        "format": FORMAT,
        "format_version": version,
        "qtool_version": manifest.qtool_version,
        "semantics": manifest.semantics,
        "quantized_file": manifest.quantized_file,
        "tensors": {name: _record_json(r, version) for name, r in manifest.tensors.items()},
    }
    return {MANIFEST_KEY: json.dumps(doc, sort_keys=True, separators=(",", ":"))}


def _record_json(record: Record, version: int) -> dict[str, object]:
    spec = record.spec
    out: dict[str, object] = {
        "scheme": spec.scheme.value,
        "dtype": spec.dtype.value,
        "qmin": spec.qmin,
        "qmax": spec.qmax,
        "orig_dtype": record.orig_dtype,
        "shape": list(record.shape),
    }
    if version == 1:
        out["axis"] = spec.axis
    else:
        out["bits"] = spec.dtype.bits
        out["granularity"] = granularity_json(spec.granularity)
        out["range_method"] = spec.range_method.value
        if record.candidates:
            out["range_search"] = {
                "algorithm": MSE_ALGORITHM,
                "candidates": list(record.candidates),
            }
    if record.method is not None:  # codes not round(x / scale) of the original: say who chose
        out["method"] = record.method
    return out


def parse_manifest(path: Path, metadata: dict[str, str] | None) -> Manifest:
    """The manifest of a sidecar's metadata, checked for format, version and semantics."""
    text = (metadata or {}).get(MANIFEST_KEY)
    if text is None:
        raise SidecarError(
            path,
            "not a qtool sidecar (no qtool.qparams manifest); give the .qparams.safetensors "
            "file written beside the quantized file, or none to use that one",
            hint="qparams",
        )
    try:
        doc = strict_json(text.encode("utf-8"))
        if not isinstance(doc, dict):
            raise SidecarError(path, "damaged manifest (not a JSON object)")
        if doc.get("format") != FORMAT:
            raise SidecarError(path, f"unknown sidecar format {doc.get('format')!r}")
        version = doc.get("format_version")
        if version not in (1, 2) or type(version) is not int:
            raise SidecarError(
                path,
                f"sidecar format version {version!r} is not supported (this qtool reads "
                f"versions 1 to {FORMAT_VERSION}); use a newer qtool release",
            )
        if doc.get("semantics") != SEMANTICS:
            raise SidecarError(path, f"unknown semantics {doc.get('semantics')!r}")
        tensors = {
            name: _parse_record(path, name, r, version) for name, r in doc["tensors"].items()
        }
        return Manifest(str(doc["quantized_file"]), tensors, doc["semantics"], doc["qtool_version"])
    except SidecarError:
        raise
    except (HeaderError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise SidecarError(path, f"damaged manifest ({type(err).__name__}: {err})") from None


def _parse_record(path: Path, name: str, r: dict[str, object], version: int) -> Record:
    shape = r["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SidecarError(path, f"shape {shape!r} is not a list of sizes", name)
    try:
        spec = QSpec(
            Scheme(r["scheme"]),
            StorageDtype(r["dtype"]),
            _parse_granularity(r, version, len(shape)),
            RangeMethod(r["range_method"]) if version >= 2 else RangeMethod.MINMAX,
        )
    except ValueError as err:
        raise SidecarError(path, f"unknown or invalid spec ({err})", name) from None
    if version == 1 and spec.dtype.value not in V1_DTYPES:
        raise SidecarError(path, f"dtype {spec.dtype.value} needs format version 2", name)
    if version >= 2 and r.get("bits") != spec.dtype.bits:
        raise SidecarError(path, f"bits {r.get('bits')!r} do not match {spec.dtype.value}", name)
    if (spec.qmin, spec.qmax) != (r["qmin"], r["qmax"]):
        raise SidecarError(path, f"range [{r['qmin']}, {r['qmax']}] does not match", name)
    return Record(spec, str(r["orig_dtype"]), tuple(shape), _parse_candidates(r, spec))


def _parse_candidates(r: dict[str, object], spec: QSpec) -> tuple[float, ...]:
    """The mse search's candidate list (recorded so anyone can recompute the scales)."""
    if spec.range_method is not RangeMethod.MSE:
        return ()
    search = r.get("range_search")
    if not isinstance(search, dict) or search.get("algorithm") != MSE_ALGORITHM:
        raise ValueError(f"range_search {search!r} is not a {MSE_ALGORITHM} record")
    candidates = search.get("candidates")
    if not isinstance(candidates, list) or not 1 <= len(candidates) <= 256:
        raise ValueError("range_search candidates must be a list of 1 to 256 numbers")
    if not all(type(c) is float and 0.0 < c < 16.0 for c in candidates):
        raise ValueError("range_search candidates must be positive multipliers")
    return tuple(candidates)


def _parse_granularity(r: dict[str, object], version: int, ndim: int) -> Granularity:
    if version == 1:
        axis = r["axis"]
        if axis is None:
            return PerTensor()
        if type(axis) is not int:
            raise ValueError(f"axis {axis!r} is not an integer")
        granularity: Granularity = PerChannel(axis)
    else:
        granularity = granularity_from_json(r["granularity"])
    if isinstance(granularity, PerChannel) and not 0 <= granularity.axis < ndim:
        raise ValueError(f"axis {granularity.axis} out of range for a {ndim}-D tensor")
    return granularity


def data_digest(path: Path, header: Header, fd: int | None = None) -> str:
    """SHA-256 of a safetensors file's data section (the sidecar's scales and zero points);
    read through `fd` (already open and checked) when given."""
    digest = hashlib.sha256()
    _hash_from(digest, path, fd, header.data_start)
    return digest.hexdigest()


def _hash_from(digest: hashlib._Hash, path: Path, fd: int | None, start: int) -> None:
    if fd is None:
        with open_regular(path) as f:
            f.seek(start)
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        return
    offset = start
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)


def is_quantized(metadata: dict[str, str] | None) -> bool:
    """Whether a safetensors file's metadata marks it as a qtool-quantized file."""
    return DIGEST_KEY in (metadata or {}) or BINDING_KEY in (metadata or {})


def tensor_table(entries: Iterable[TensorEntry]) -> bytes:
    """The quantized file's tensor table (names, dtypes, shapes, offsets) as canonical bytes."""
    ordered = sorted(entries, key=lambda e: (e.begin, e.end, e.name))
    table = [[e.name, e.dtype, list(e.shape), e.begin, e.end] for e in ordered]
    return json.dumps(table, separators=(",", ":")).encode("ascii")


def binding_digest(entries: Iterable[TensorEntry], sidecar: Path, fd: int | None = None) -> str:
    """SHA-256 of the quantized file's tensor table, then every byte of the sidecar file (read
    through `fd`, already open and checked, when given)."""
    digest = hashlib.sha256(tensor_table(entries))
    _hash_from(digest, sidecar, fd, 0)
    return digest.hexdigest()


def validate_qparams(
    path: Path, name: str, record: Record, scale: torch.Tensor, zero_point: torch.Tensor
) -> None:
    """Refuse qparams that would make dequantization meaningless (or crash a torch kernel)."""
    expected = qparam_shape(record.spec.granularity, record.shape)
    if tuple(scale.shape) != expected or tuple(zero_point.shape) != expected:
        raise SidecarError(
            path,
            f"scale/zero_point shapes {list(scale.shape)}/{list(zero_point.shape)} do not match "
            f"{list(expected)}",
            name,
        )
    if not bool(scale.isfinite().all()) or bool((scale < SMALLEST_NORMAL).any()):
        raise SidecarError(path, "scale holds zero, negative, subnormal, NaN or Inf values", name)
    qmin, qmax = record.spec.qmin, record.spec.qmax
    if bool((zero_point < qmin).any()) or bool((zero_point > qmax).any()):
        raise SidecarError(path, f"zero_point outside [{qmin}, {qmax}]", name)
    if not math.isfinite(float(grid_reach(record, scale, zero_point))):
        raise SidecarError(path, "scales so large that codes dequantize to infinity", name)


def grid_reach(record: Record, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """The largest |x_hat| any code can dequantize to, computed in float32 as dequantize does."""
    import torch  # this module stays torch-free at import time (inspect)

    zp = zero_point.float()
    spec = record.spec
    reach = torch.maximum((spec.qmax - zp).abs(), (spec.qmin - zp).abs())
    return (reach * scale.float()).amax() if reach.numel() else scale.new_zeros(())
