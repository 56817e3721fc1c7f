"""A GGUF file's tensors under the Hugging Face names of the checkpoint it was converted from,
in that checkpoint's layout, so the two can be compared tensor by tensor.

Names: gguf-py's TensorNameMap for the file's architecture and block count (the table
convert_hf_to_gguf.py names tensors with). Layout: torch order is GGUF's shape reversed (the
reader's already), and for the llama family convert_hf_to_gguf.py permutes the rows of the q
and k projections for its rotary embedding (LlamaModel.permute); `to_hf` undoes that, as
transformers' GGUF loader does. A tensor neither side can place is listed with the reason,
never dropped; so is a Hugging Face tensor the GGUF lacks.

    pairing = pair_names(reader.header, hf_names)
    view = HFView(reader, pairing)          # a FloatReader: view.values("model.layers.0...")
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qtool.errors import InputError, UsageError
from qtool.formats.base import FloatReader
from qtool.formats.gguf.reader import INSTALL_GGUF, GGUFFloatReader
from qtool.formats.gguf.summary import ARCH_KEY
from qtool.formats.registry import Matched
from qtool.io.gguf_layout import GGUFHeader, GGUFValue
from qtool.spec import Codec

# architectures whose converter permutes attn_q/attn_k rows from the Hugging Face layout with
# LlamaModel.permute (conversion/llama.py and its subclasses, deepseek.py, llada.py)
PERMUTED_ARCHS = ("llama", "arcee", "smollm3", "llama-embed", "deepseek", "llada")
SUFFIXES = (".weight", ".bias")
MAX_BLOCKS = 512  # llama.cpp's LLAMA_MAX_LAYERS: it loads no model of more blocks
MAX_ARCH_CHARS = 64  # llama.cpp's architecture names are under 20 characters
_BLOCK = re.compile(r"(?:^|\.)blk\.(\d+)\.")


@dataclass(frozen=True)
class Placement:
    """The GGUF tensor `gguf` holds the Hugging Face tensor `hf`; `note`: what it took."""

    hf: str
    gguf: str
    note: str = ""


@dataclass(frozen=True)
class Pairing:
    """Every tensor of both sides: placed in pairs, or listed with why it could not be."""

    arch: str
    placed: list[Placement]
    gguf_unplaced: list[tuple[str, str]] = field(default_factory=list)
    hf_unplaced: list[tuple[str, str]] = field(default_factory=list)
    heads: tuple[int, int] | None = None  # (q heads, kv heads) when rows are un-permuted


def pair_names(header: GGUFHeader, hf_names: Sequence[str], path: Path | None = None) -> Pairing:
    """Match the GGUF's tensors (the file `path`, for messages) with the Hugging Face names
    `hf_names`."""
    arch = _arch(header, path)
    tmap = _name_map(arch, _block_count(header, arch, path), path)
    present = {t.name for t in header.tensors}
    heads = _heads(header, arch, path) if arch in PERMUTED_ARCHS else None
    placed: list[Placement] = []
    hf_unplaced: list[tuple[str, str]] = []
    taken: set[str] = set()
    for hf in hf_names:
        name = tmap.get_name(hf, try_suffixes=SUFFIXES)
        tied = name == "output.weight" and name not in present and "token_embd.weight" in present
        if tied:
            placed.append(Placement(hf, "token_embd.weight", TIED))
        elif name is None:
            hf_unplaced.append((hf, f"gguf's name map for {arch} has no GGUF name for it"))
        elif name not in present:
            hf_unplaced.append((hf, f"maps to {name}, which the GGUF file lacks"))
        elif name in taken:
            hf_unplaced.append((hf, f"maps to {name}, which another tensor maps to already"))
        else:
            taken.add(name)
            placed.append(Placement(hf, name, _note(name, heads)))
    taken.update(p.gguf for p in placed)
    gguf_unplaced = [
        (t.name, "no tensor of the Hugging Face checkpoint maps to it")
        for t in header.tensors
        if t.name not in taken
    ]
    return Pairing(arch, placed, gguf_unplaced, hf_unplaced, heads)


def gguf_names(arch: str, n_blocks: int, hf_names: Sequence[str]) -> dict[str, str]:
    """The GGUF name gguf-py's name map gives each Hugging Face name it places, for a model of
    architecture `arch` with `n_blocks` blocks (names a file need not hold, unlike pair_names)."""
    tmap = _name_map(arch, n_blocks)
    found = {hf: tmap.get_name(hf, try_suffixes=SUFFIXES) for hf in hf_names}
    return {hf: name for hf, name in found.items() if name is not None}


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def expert_names(arch: str, n_blocks: int, hf_names: Sequence[str]) -> dict[str, tuple[str, int]]:
    """For each of `hf_names` that is one expert's Linear of a checkpoint storing its experts
    apart (`model.layers.0.block_sparse_moe.experts.3.w1.weight`): the GGUF name of the stacked
    weight llama.cpp's converter merges the experts into (`blk.0.ffn_gate_exps.weight`, its
    matrix e holding expert e) and the expert's index (3)."""
    tmap = _name_map(arch, n_blocks)
    out: dict[str, tuple[str, int]] = {}
    for hf in hf_names:
        found = _EXPERT.search(hf)
        if found is None:
            continue
        merged = f"{hf[: found.start()]}.experts.{hf[found.end() :]}"
        name = tmap.get_name(merged, try_suffixes=SUFFIXES)
        if name is not None and "_exps." in name:
            out[hf] = (name, int(found.group(1)))
    return out


TIED = "tied: the GGUF stores token_embd.weight once for both"


def _note(name: str | None, heads: tuple[int, int] | None) -> str:
    if name is None or heads is None or not _permuted(name):
        return ""
    return "rows un-permuted (the converter's rotary permutation)"


def _permuted(gguf_name: str) -> bool:
    return ".attn_q." in gguf_name or ".attn_k." in gguf_name


def to_hf(gguf_name: str, x: torch.Tensor, heads: tuple[int, int] | None) -> torch.Tensor:
    """The GGUF tensor `x` (torch order) in the Hugging Face layout: the rows of attn_q/attn_k
    (weight or bias) un-permuted when `heads` (q heads, kv heads) says the converter permuted
    them: transformers' _reverse_permute_weights."""
    if heads is None or not _permuted(gguf_name):
        return x
    n_head = heads[0] if ".attn_q." in gguf_name else heads[1]
    rows = x.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{gguf_name}: {rows} rows are not {n_head} heads of pairs")
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _arch(header: GGUFHeader, path: Path | None) -> str:
    found = header.metadata.get(ARCH_KEY)
    if found is None or not isinstance(found.value, str):
        raise InputError(path, f"no {ARCH_KEY}: cannot tell how its tensors are named")
    if len(found.value) > MAX_ARCH_CHARS:
        raise InputError(path, f"{ARCH_KEY} is {len(found.value):,} characters long, not an "
                         "architecture llama.cpp knows; is the file intact?")  # fmt: skip
    return found.value


def _uint(value: GGUFValue | None) -> int | None:
    if value is None or isinstance(value.value, (str, tuple, bool, float)):
        return None
    return int(value.value) if not hasattr(value.value, "shape") else None


def _block_count(header: GGUFHeader, arch: str, path: Path | None) -> int:
    """The blocks the tensors name (the highest blk.N + 1): what the name map is built for,
    whatever `{arch}.block_count` says. A file declaring more blocks than its tensors name, or
    naming more than llama.cpp loads, is refused (its name map would cost work and memory in
    proportion to a number, not to the file)."""
    key = f"{arch}.block_count"
    blocks, last = 0, ""
    for t in header.tensors:
        found = _BLOCK.search(t.name)
        if found is not None and int(found[1]) >= blocks:
            blocks, last = int(found[1]) + 1, t.name
    if blocks > MAX_BLOCKS:
        raise InputError(path, f"it is in block {blocks - 1}, over llama.cpp's limit "
                         f"of {MAX_BLOCKS} blocks; is the file intact?", last)  # fmt: skip
    declared = _uint(header.metadata.get(key))
    if declared is not None and declared > blocks:
        named = f"blocks 0 to {blocks - 1}" if blocks else "no block (no blk.N tensor)"
        raise InputError(path, f"{key} is {declared}, but its tensors name {named}; the "
                         "header does not match its tensors (is the file intact?)")  # fmt: skip
    return blocks


def _heads(header: GGUFHeader, arch: str, path: Path | None) -> tuple[int, int]:
    """(q heads, kv heads) for undoing the converter's rotary permutation, refused with the key
    named unless every attn_q/attn_k tensor's rows are whole heads of pairs."""
    q_key, kv_key = f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"
    q = _uint(header.metadata.get(q_key))
    kv = _uint(header.metadata.get(kv_key))
    if q is None or q <= 0:
        raise InputError(path, f"no single positive {q_key}: cannot undo the converter's rotary "
                         "permutation of attn_q/attn_k")  # fmt: skip
    if kv is not None and kv < 0:
        raise InputError(path, f"{kv_key} is {kv}: a head count cannot be negative")
    heads = (q, kv if kv else q)
    for t in header.tensors:
        if not _permuted(t.name):
            continue
        n, key = (heads[0], q_key) if ".attn_q." in t.name else (heads[1], kv_key)
        rows = t.torch_shape[0] if t.shape else 1
        if rows % (2 * n):
            raise InputError(path, f"{key} is {n}, but {t.name} has {rows} rows, not {n} heads "
                             "of pairs: cannot undo the converter's rotary permutation",
                             t.name)  # fmt: skip
    return heads


def _name_map(arch: str, n_blocks: int, path: Path | None = None) -> _Names:
    if importlib.util.find_spec("gguf") is None:
        raise UsageError(None, "matching GGUF tensors with Hugging Face names needs the gguf "
                         f"package; install it with {INSTALL_GGUF}")  # fmt: skip
    import gguf

    archs = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in archs:
        raise InputError(path, f"{ARCH_KEY} is {arch!r}, which the installed gguf package "
                         f"({_gguf_version()}) does not know: if llama.cpp reads it, upgrade "
                         "gguf (pip install -U gguf); else the file is not a model qtool can "
                         "match")  # fmt: skip
    return _Names(gguf.TensorNameMap(archs[arch], n_blocks))


def _gguf_version() -> str:
    try:
        return f"version {importlib.metadata.version('gguf')}"
    except importlib.metadata.PackageNotFoundError:
        return "version unknown"


class _Names:
    """gguf.TensorNameMap, typed."""

    def __init__(self, tmap: object) -> None:
        self._tmap = tmap

    def get_name(self, key: str, try_suffixes: Sequence[str]) -> str | None:
        found = self._tmap.get_name(key, try_suffixes=try_suffixes)  # type: ignore[attr-defined]
        return found if isinstance(found, str) else None


class HFView:
    """The placed GGUF tensors as a FloatReader under their Hugging Face names, in the Hugging
    Face layout; with `unplaced`, also the GGUF tensors no Hugging Face name maps to, under
    their GGUF names and in GGUF's torch order (for a comparison to list; else they are the
    caller's to report)."""

    def __init__(self, reader: GGUFFloatReader, pairing: Pairing, unplaced: bool = False) -> None:
        self.reader, self.pairing, self.path = reader, pairing, reader.path
        self._gguf = {p.hf: p.gguf for p in pairing.placed}
        if unplaced:
            self._gguf |= {name: name for name, _ in pairing.gguf_unplaced}

    @property
    def names(self) -> list[str]:
        return list(self._gguf)

    @property
    def metadata(self) -> dict[str, str] | None:
        return None

    def gguf_name(self, name: str) -> str:
        return self._gguf[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(self._gguf[name])

    def dtype(self, name: str) -> str:
        return self.reader.dtype(self._gguf[name])

    def quantization(self, name: str) -> Codec | None:
        return self.reader.quantization(self._gguf[name])

    def values(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        gguf_name = self._gguf[name]
        heads = self.pairing.heads if gguf_name != name else None  # an unplaced one: as it is
        return to_hf(gguf_name, self.reader.values(gguf_name, dtype), heads)

    def raw(self, name: str) -> memoryview:
        gguf_name = self._gguf[name]
        if _permuted(gguf_name) and self.pairing.heads is not None:
            raise ValueError(f"{name}: its GGUF rows are permuted; read its values")
        return self.reader.raw(gguf_name)

    def nbytes(self, name: str) -> int:
        return self.reader.nbytes(self._gguf[name])

    def stored_dtype(self, name: str) -> str:
        return self.reader.stored_dtype(self._gguf[name])

    def file_of(self, name: str) -> Path:
        return self.reader.path

    @property
    def sidecars(self) -> list[Path]:
        return []

    def restored_files(self) -> dict[str, bytes]:
        return {}

    def release(self, name: str) -> None:
        self.reader.release(self._gguf[name])

    def check_unchanged(self) -> None:
        self.reader.check_unchanged()

    def close(self) -> None:
        self.reader.close()


def matched(reader: FloatReader, hf_names: Sequence[str]) -> Matched:
    """A GGUF reader (registry.open_reader's) under the Hugging Face names `hf_names`: the
    placed tensors renamed and un-permuted, the GGUF tensors nothing maps to under their own
    names, and every name of either side without a counterpart with why."""
    if not isinstance(reader, GGUFFloatReader):
        raise TypeError(f"a GGUF reader is needed, not {type(reader).__name__}")
    pairing = pair_names(reader.header, hf_names, reader.path)
    unplaced = dict(pairing.hf_unplaced) | dict(pairing.gguf_unplaced)
    placed = {p.hf: p.gguf for p in pairing.placed}
    return Matched(HFView(reader, pairing, unplaced=True), unplaced, placed)


def hf_view(reader: GGUFFloatReader, hf_names: Sequence[str]) -> tuple[FloatReader, Pairing]:
    """The GGUF's tensors as a FloatReader under the Hugging Face names `hf_names` (mypy checks
    here that HFView is one), and the pairing with what could not be placed."""
    pairing = pair_names(reader.header, hf_names, reader.path)
    return HFView(reader, pairing), pairing
