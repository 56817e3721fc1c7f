"""The float model's side of `qtool eval`, kept in a file (`--save-logits`, read back by
`--logits`): per scored position the next token's NLL, the argmax and every log-probability in
16 bits (numerics/logits.Coded, like llama-perplexity's --kl-divergence-base, over 24 nats),
and what they were
computed on (the text's
SHA-256, the token ids, ctx, dtype, the model's config and tokenizer digests), so that a file
made for other tokens or another model is refused rather than compared.

Layout (little-endian): MAGIC, u32 version, u32 0, u64 header length, the header (strict JSON,
at most MAX_HEADER_BYTES), then the arrays in this order: token ids i32 [N], nll f32 [n],
argmax i32 [n], scale f32 [n], floor f32 [n], codes u16 [n, vocab]; n is N less one per
window. Every count is checked against the file's size and every value against
its range before anything is used (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from qtool.errors import InputError
from qtool.io.jsonfile import parse_json
from qtool.io.safeopen import open_regular
from qtool.numerics.logits import CODE_RANGE, CODE_STEPS, Coded, FloatRows

MAGIC = b"QTLOGITS"
VERSION = 1
MAX_HEADER_BYTES = 16 << 20  # the windows' lengths and a few digests; 16 MiB is far above
MAX_PAYLOAD_BYTES = 8 << 30  # what one read may load into memory
MAX_VOCAB = 1 << 24
MAX_WINDOWS = 1 << 20  # each window is a few small tensors (~3 KB): at most ~3 GB of them
CHECK_ELEMENTS = 1 << 22  # codes checked per step: bounds the float64 temporaries (~100 MB)
_PREFIX = struct.Struct("<8sIIQ")


@dataclass(frozen=True)
class LogitsInfo:
    """What the logits were computed on: a file is used only where all of it matches."""

    text_sha256: str
    text_source: str
    tokens_sha256: str  # of the token ids (int32 little-endian)
    tokens: int
    ctx: int
    dtype: str
    config_sha256: str
    tokenizer_sha256: str
    architecture: str
    vocab: int
    windows: tuple[int, ...]  # each window's length in tokens

    def as_json(self) -> dict[str, Any]:
        return {
            "text": {"sha256": self.text_sha256, "source": self.text_source},
            "tokens": {"count": self.tokens, "sha256": self.tokens_sha256},
            "ctx": self.ctx,
            "dtype": self.dtype,
            "model": {
                "config_sha256": self.config_sha256,
                "tokenizer_sha256": self.tokenizer_sha256,
                "architecture": self.architecture,
                "vocab": self.vocab,
            },
            "coding": {"bits": 16, "range_nats": CODE_RANGE, "steps": CODE_STEPS},
            "windows": list(self.windows),
        }


def tokens_digest(ids: Sequence[int]) -> str:
    import hashlib

    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def write_logits(
    f: BinaryIO,
    info: LogitsInfo,
    ids: Sequence[int],
    rows: list[FloatRows],
    digests: dict[str, str],
) -> None:
    """The file's bytes to `f` (an OutputSet's temp): every window's coded rows, and the
    SHA-256 of each of FLOAT's parameters (which weights a candidate changed)."""
    doc = {"version": VERSION, **info.as_json(), "parameters": digests}
    header = json.dumps(doc, sort_keys=True).encode()
    f.write(_PREFIX.pack(MAGIC, VERSION, 0, len(header)) + header)
    coded = [r.coded for r in rows]
    if any(c is None for c in coded):
        raise ValueError("write_logits needs coded rows")
    f.write(np.asarray(ids, dtype="<i4").tobytes())
    for name, dtype in (("nll", "<f4"), ("argmax", "<i4")):
        for r in rows:
            f.write(getattr(r, name).numpy().astype(dtype).tobytes())
    for name, dtype in (("scale", "<f4"), ("floor", "<f4"), ("codes", "<i2")):
        for c in coded:
            assert c is not None
            f.write(getattr(c, name).numpy().astype(dtype).tobytes())


def read_logits(
    path: Path, expect: Callable[[LogitsInfo], None] | None = None
) -> tuple[LogitsInfo, list[int], list[FloatRows], dict[str, str]]:
    """The file's description, its token ids, each window's float rows and FLOAT's parameter
    digests; InputError naming the file for anything out of its bounds (version, counts,
    sizes, values). `expect` sees the header before any array is read (it refuses a file made
    for another run), so what is allocated is what this run would hold anyway."""
    with open_regular(path) as f:
        info, digests = _header(f, path)
        n_tokens, n = info.tokens, info.tokens - len(info.windows)
        sizes = [4 * n_tokens, 4 * n, 4 * n, 4 * n, 4 * n, 2 * n * info.vocab]
        if sum(sizes) > MAX_PAYLOAD_BYTES:
            raise InputError(path, f"arrays of {sum(sizes):,} bytes are over {MAX_PAYLOAD_BYTES:,}")
        if os.fstat(f.fileno()).st_size != f.tell() + sum(sizes):
            raise InputError(path, "its size is not what its header describes (truncated?)")
        if expect is not None:
            expect(info)
        parts = [_read_exactly(f, size, path) for size in sizes]
        if f.read(1):
            raise InputError(path, "its size is not what its header describes (truncated?)")
    # little-endian on every platform torch runs on: astype(copy=False) is a view, not a copy
    ids, nll, argmax, scale, floor, codes = (
        np.frombuffer(p, dtype=d).astype(d[1:], copy=False)
        for p, d in zip(parts, ("<i4", "<f4", "<i4", "<f4", "<f4", "<i2"), strict=True)
    )
    codes = codes.reshape(-1, info.vocab)
    _check_values(path, info, ids, nll, argmax, scale, floor, codes)
    if tokens_digest(ids.tolist()) != info.tokens_sha256:
        raise InputError(path, "its token ids do not match their recorded SHA-256")
    rows, start = [], 0
    for length_w in info.windows:
        s, e = start, start + length_w - 1
        coded = Coded(torch.from_numpy(codes[s:e]), torch.from_numpy(scale[s:e].copy()),
                      torch.from_numpy(floor[s:e].copy()))  # fmt: skip
        rows.append(FloatRows(torch.from_numpy(nll[s:e].copy()),
                              torch.from_numpy(argmax[s:e]).long(), None, coded))  # fmt: skip
        start = e
    return info, ids.tolist(), rows, digests


def _read_exactly(f: BinaryIO, size: int, path: Path) -> bytearray:
    """`size` bytes into one writable buffer (no second copy, as joining reads would make)."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:  # one read(2) returns at most ~2 GiB
        n = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise InputError(path, "its size is not what its header describes (truncated?)")
        got += n
    return buf


def read_logits_info(path: Path) -> LogitsInfo:
    """The file's description alone (its header, checked as read_logits checks it)."""
    with open_regular(path) as f:
        return _header(f, path)[0]


def _header(f: BinaryIO, path: Path) -> tuple[LogitsInfo, dict[str, str]]:
    prefix = f.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size or prefix[:8] != MAGIC:
        raise InputError(path, "not a qtool logits file (made by qtool eval --save-logits)")
    _, version, _, length = _PREFIX.unpack(prefix)
    if version != VERSION:
        raise InputError(path, f"logits file version {version}; this qtool reads {VERSION}")
    if length > MAX_HEADER_BYTES:
        raise InputError(path, f"header of {length:,} bytes is over {MAX_HEADER_BYTES:,}")
    header = f.read(length)
    if len(header) != length:
        raise InputError(path, "truncated: the header ends early")
    doc = parse_json(header, path, "logits file header")
    return _info(doc, path), _digests(doc, path)


def _digests(doc: object, path: Path) -> dict[str, str]:
    found = doc.get("parameters") if isinstance(doc, dict) else None
    if not isinstance(found, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in found.items()
    ):
        raise InputError(path, "not a valid logits file header: parameters")
    return found


def _info(doc: object, path: Path) -> LogitsInfo:
    def bad(what: str) -> InputError:
        return InputError(path, f"not a valid logits file header: {what}")

    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise bad("expected a JSON object of version 1")
    big = 1 << 31

    def field(keys: str, lo: int | None = None, hi: int = big) -> Any:
        value: Any = doc
        for key in keys.split("."):
            if not isinstance(value, dict) or key not in value:
                raise bad(f"{keys} is missing")
            value = value[key]
        if lo is None:
            if not isinstance(value, str) or len(value) > 4096:
                raise bad(f"{keys} is not a string")
        elif isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise bad(f"{keys} is not an integer from {lo} to {hi}: {str(value)[:40]}")
        return value

    windows = doc.get("windows")
    if not isinstance(windows, list) or not windows:
        raise bad("windows is not a list of window lengths")
    if len(windows) > MAX_WINDOWS:
        raise bad(f"{len(windows):,} windows, over {MAX_WINDOWS:,}")
    for w in windows:
        if isinstance(w, bool) or not isinstance(w, int) or not 2 <= w <= big:
            raise bad(f"windows holds {str(w)[:40]}, not a length of 2 tokens or more")
    info = LogitsInfo(
        field("text.sha256"), field("text.source"), field("tokens.sha256"),
        field("tokens.count", 2), field("ctx", 2), field("dtype"),
        field("model.config_sha256"), field("model.tokenizer_sha256"),
        field("model.architecture"), field("model.vocab", 1, MAX_VOCAB),
        tuple(windows),
    )  # fmt: skip
    if sum(info.windows) != info.tokens:
        raise bad("its windows do not add up to its tokens")
    if max(info.windows) > info.ctx:
        raise bad("a window is longer than ctx")
    if doc.get("coding") != {"bits": 16, "range_nats": CODE_RANGE, "steps": CODE_STEPS}:
        raise bad("coding is not this qtool's (16 bits over 24 nats)")
    return info


def _check_values(path: Path, info: LogitsInfo, *arrays: np.ndarray) -> None:
    ids, nll, argmax, scale, floor, codes = arrays
    for name, a in (("token id", ids), ("argmax", argmax)):
        if a.size and (a.min() < 0 or a.max() >= info.vocab):
            raise InputError(path, f"a {name} is outside the vocabulary of {info.vocab:,}")
    if not (np.isfinite(nll).all() and (nll >= 0).all()):
        raise InputError(path, "an NLL is negative, infinite or NaN")
    top = floor + scale * CODE_STEPS
    if not (np.isfinite(top).all() and (scale >= 0).all() and (top <= 1e-3).all()):
        raise InputError(path, "a position's scale or floor is out of range")
    firsts = np.cumsum((0, *info.windows[:-1]))  # a window's first token is never predicted
    targets = np.delete(ids, firsts)
    step = max(1, CHECK_ELEMENTS // info.vocab)
    for r in range(0, codes.shape[0], step):
        _check_rows(path, slice(r, r + step), codes, scale, floor, nll, argmax, targets)


def _check_rows(path: Path, rows: slice, codes: np.ndarray, *per_row: np.ndarray) -> None:
    """Positions `rows`: the probabilities sum to 1, the NLL is -ln p of the next token as the
    codes give it (within the coding's step; at least the floor's where it is coded 0), and the
    argmax holds the highest code: numbers that disagree with the codes are refused."""
    scale, floor, nll, argmax, targets = (a[rows].astype(np.float64) for a in per_row)
    c = codes[rows].astype(np.int64) & 0xFFFF
    logp = floor[:, None] + (c - 1) * scale[:, None]
    total = np.logaddexp.reduce(np.where(c > 0, logp, -np.inf), axis=1)
    if not np.all(np.abs(total) < 1e-2):
        raise InputError(path, "a position's probabilities do not sum to 1")
    at = np.arange(c.shape[0])
    target_code = c[at, targets.astype(np.int64)]
    tol = scale + 1e-3  # half a step of rounding, float32's error on ln p, and margin
    coded_nll = -(floor + (target_code - 1) * scale)
    ok = np.where(target_code > 0, np.abs(nll - coded_nll) <= tol, nll >= -floor - tol)
    if not ok.all():
        raise InputError(path, "an NLL disagrees with its position's coded probabilities")
    if not np.all(c[at, argmax.astype(np.int64)] == c.max(axis=1)):
        raise InputError(path, "an argmax is not its position's most probable token")
