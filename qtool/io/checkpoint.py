"""Reading checkpoints one tensor at a time (the streaming writer is io/writer.py).

.safetensors: the header is validated first (stformat), then each tensor is read with pread into
memory qtool owns. Not mapped: a file truncated under a mapping kills the process with SIGBUS,
which Python cannot catch; a short read is an error instead ("changed while reading"). A caller
that reads tensor after tensor (the quantize loop) passes a ReadBuffer: one block of memory,
touched once, that every read reuses (fresh memory costs a page fault per page on first touch,
which made reads six times slower than the copy itself).
Torch pickles (.pt/.pth/.bin): `torch.load(weights_only=True)` only, never a fallback, after a
scan of the zip directory that refuses compressed members (zip bombs); only tensors are kept.
"""

from __future__ import annotations

import io
import os
import re
import weakref
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from qtool.dtypes import DTYPE_BITS, DTYPES
from qtool.errors import ChangedError, InputError, UnsafeInputError
from qtool.io.filestamp import CHANGED, FileStamp, ReadLog, changed_message, fstamp, stamp
from qtool.io.readbuffer import ReadBuffer
from qtool.io.safeopen import InputDir, open_regular
from qtool.io.stformat import (
    Header,
    HeaderError,
    TensorEntry,
    describe_head,
    describe_non_checkpoint,
    not_safetensors_message,
    parse_header,
    read_header,
    read_header_file,
)

PICKLE_SUFFIXES = (".pt", ".pth", ".bin")
# A pickle's views may claim more bytes than it stores (stride-0 expands, one storage under many
# names). Tied weights and shared layers claim a few times their storage; a 1.5 KB file claiming
# 10 GB is an attack. Allowed: this many times the stored bytes, and at least MIN_CLAIM_BYTES.
MAX_CLAIM_RATIO = 16
MIN_CLAIM_BYTES = 1 << 30
MIN_TORCH_FOR_PICKLES = (2, 10)  # weights_only had code-execution holes before 2.6 and 2.10
STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model", "module")

ST_TO_TORCH: dict[str, torch.dtype] = {
    name: getattr(torch, d.torch_name) for name, d in DTYPES.items() if d.torch_name
}
TORCH_TO_ST = {v: k for k, v in ST_TO_TORCH.items()}


@dataclass
class Checkpoint:
    """An open checkpoint: its tensors' entries in file order and lazy access to their data."""

    path: Path
    entries: tuple[TensorEntry, ...]
    metadata: dict[str, str] | None
    skipped: list[str] = field(default_factory=list)  # non-tensor entries of a pickle
    _fd: int = -1  # the open file, for safetensors; closed by close() or when garbage collected
    _data_start: int = 0
    _tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    _stat: FileStamp = (0, 0, 0, 0, 0)  # filestamp.stamp at open, what check_unchanged compares
    _by_name: dict[str, TensorEntry] = field(default_factory=dict)
    _log: ReadLog | None = None  # what was read through _fd, for check_unchanged

    @property
    def descriptor(self) -> int | None:
        """The open safetensors file this checkpoint reads through (None: a pickle)."""
        return self._fd if self._fd >= 0 else None

    @property
    def data_start(self) -> int:
        return self._data_start

    def by_name(self) -> dict[str, TensorEntry]:
        """Entries by tensor name (built once: callers look tensors up one by one)."""
        if len(self._by_name) != len(self.entries):
            self._by_name = {e.name: e for e in self.entries}
        return self._by_name

    def tensor(self, entry: TensorEntry, into: ReadBuffer | None = None) -> torch.Tensor:
        """The tensor as a CPU torch tensor, read for safetensors into a fresh buffer, or into
        `into` (valid until the next read into it)."""
        return self.rows(entry, 0, entry.shape[0] if entry.shape else 1, into)

    def rows(
        self, entry: TensorEntry, start: int, stop: int, into: ReadBuffer | None = None
    ) -> torch.Tensor:
        """Rows [start, stop) along the first dimension (the whole of a 0-d tensor), read as
        `tensor` reads them: a slab of a large tensor needs only memory of its own size."""
        dtype = ST_TO_TORCH.get(entry.dtype)
        if dtype is None:
            raise InputError(
                self.path, f"dtype {entry.dtype} is not supported by torch", entry.name
            )
        whole = start == 0 and stop == (entry.shape[0] if entry.shape else 1)
        if entry.name in self._tensors:
            t = self._tensors[entry.name]
            return t if whole else t[start:stop]
        shape = entry.shape if whole else (stop - start, *entry.shape[1:])
        if entry.numel == 0 or self._fd < 0:
            return torch.empty(shape, dtype=dtype)
        row = entry.nbytes // entry.shape[0] if entry.shape else entry.nbytes
        span = TensorEntry(entry.name, entry.dtype, shape, entry.begin + start * row,
                           entry.begin + stop * row)  # fmt: skip
        return self._read(span, into).view(dtype).view(shape)

    def tensors(self, entries: Sequence[TensorEntry]) -> list[torch.Tensor]:
        """Several tensors (of dtypes torch has), as `tensor` gives them; for safetensors each
        run of entries lying close together in the file is read with one pread (tiny tensors:
        one read each costs more than the bytes)."""
        if self._fd < 0 or self._tensors:
            return [self.tensor(e) for e in entries]
        out: dict[str, torch.Tensor] = {}
        for run in _runs(sorted(entries, key=lambda e: e.begin)):
            first, last = run[0], run[-1]
            span = TensorEntry(first.name, "U8", (), first.begin, last.end)
            data = self._read(span)
            for e in run:
                piece = data[e.begin - first.begin : e.end - first.begin]
                out[e.name] = piece.view(ST_TO_TORCH[e.dtype]).view(e.shape)
        return [out[e.name] for e in entries]

    def raw(self, entry: TensorEntry) -> memoryview:
        """The tensor's bytes exactly as stored (little-endian, C order)."""
        if entry.name in self._tensors:
            return tensor_bytes(self._tensors[entry.name])
        if self._fd < 0 or entry.nbytes == 0:
            return memoryview(b"")
        return self._read(entry).numpy().data

    def _read(self, entry: TensorEntry, into: ReadBuffer | None = None) -> torch.Tensor:
        """The entry's bytes as a uint8 tensor; a short read means the file shrank under us."""
        buf = torch.empty(entry.nbytes, dtype=torch.uint8) if into is None else (
            into.take(entry.nbytes))  # fmt: skip
        view = buf.numpy().data
        start, done = self._data_start + entry.begin, 0
        while done < entry.nbytes:
            n = os.preadv(self._fd, [view[done:]], start + done)
            if n == 0:
                raise ChangedError(
                    self.path,
                    f"changed while reading (ended {entry.nbytes - done:,} bytes early); "
                    "run again once nothing is writing it",
                    entry.name,
                )
            done += n
        if self._log is not None:
            self._log.note(start, view)
        return buf

    def release(self, entry: TensorEntry) -> None:
        """Done with a tensor. Nothing to drop: tensors are read into buffers that are freed
        with their last reference (kept so callers need not know how a file is read)."""

    def check_unchanged(self) -> None:
        """Fail if the file was modified while it was being read (its data may be torn): the
        descriptor read from is checked (filestamp.ReadLog: a change of its status alone passes
        once what was read reads the same again). A pickle was read whole, and checked, when it
        was opened: its path is checked to still name that file, at its size and mtime (not the
        ctime: what moves it alone changes no byte the run holds)."""
        if self._log is not None and self._fd >= 0:
            if not self._log.unchanged(self._fd, self.path):
                raise ChangedError(self.path, changed_message(self._log))
        elif self._tensors:
            try:
                now = stamp(os.stat(self.path))
            except OSError:
                raise ChangedError(self.path, CHANGED) from None
            if now[:4] != self._stat[:4]:
                raise ChangedError(self.path, CHANGED)

    def close(self) -> None:
        """Let go of the file (tensors already read stay valid: they own their memory)."""
        self._tensors.clear()
        if self._fd >= 0:
            self._closer()
            self._fd = -1

    def adopt(self, fd: int, parse: Callable[[bytes], Header | None]) -> None:
        """Read tensors from the open descriptor `fd` (closed with the checkpoint), the file
        `_stat` stamped before its header was parsed; `parse(head)`: the header the file's
        first bytes give (None: none). Those bytes are the first span of the log
        check_unchanged re-reads (the tensors' offsets and dtypes come from them), so they must
        be the header's: the file unchanged since the stamp, or, where only its ctime moved (a
        chmod, or a rewrite with the mtime put back: the ReadLog tells them apart later), the
        bytes parsed again to the same header."""
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, fd)
        self._log = ReadLog(self._stat)
        head = _pread_all(fd, self._data_start)
        now = fstamp(fd)
        if len(head) < self._data_start or now[:4] != self._stat[:4]:
            raise ChangedError(self.path, CHANGED)  # the bytes read are not the file stamped
        if now != self._stat and parse(head) != Header(self.entries, self.metadata,
                                                       self._data_start):  # fmt: skip
            raise ChangedError(self.path, CHANGED)
        self._log.note(0, head)


def _pread_all(fd: int, n: int) -> bytes:
    """The file's first `n` bytes (fewer: it is shorter)."""
    parts, done = [], 0
    while done < n and (part := os.pread(fd, n - done, done)):
        parts.append(part)
        done += len(part)
    return b"".join(parts)


READ_GAP = 1 << 16  # bytes between two tensors read along with them rather than a second pread


def _runs(entries: list[TensorEntry]) -> Iterator[list[TensorEntry]]:
    """Entries (sorted by offset) in runs whose gaps are at most READ_GAP bytes."""
    run: list[TensorEntry] = []
    for e in entries:
        if run and e.begin - run[-1].end > READ_GAP:
            yield run
            run = []
        run.append(e)
    if run:
        yield run


_NUMPY_DTYPES = frozenset(
    (torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16)
    + (torch.int32, torch.int64, torch.bool)
)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Bytes of a CPU tensor in C order (a zero-copy view when it is already contiguous)."""
    numpy_view = t.is_cpu and t.dtype in _NUMPY_DTYPES and not t.requires_grad
    if numpy_view and t.is_contiguous() and t.numel():
        return t.numpy().data.cast("B")  # the same bytes in a third of the time
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


def open_checkpoint(path: Path, within: InputDir | None = None) -> Checkpoint:
    """Open a .safetensors file or a torch pickle state dict, validating before any data is read.
    `within`: the checkpoint directory `path` lies in, held open; the file is then opened once
    through it (no link followed out of it) and its header and data read through that one
    descriptor (a directory's shards are safetensors: pickles are never read from one)."""
    if within is not None:
        return _open_within(path, within)
    _check_regular_file(path)
    kind, header = sniff(path)
    if kind == "gguf":  # llama.cpp's format: its float tensors read like any checkpoint's
        from qtool.io.gguf_checkpoint import open_gguf_data

        gguf, fd, stat = open_gguf_data(path)
        ckpt = Checkpoint(path, gguf.tensors, None, _data_start=gguf.data_start, _stat=stat)
        ckpt.adopt(fd, lambda head: _gguf_header(head, stat[2]))
        return ckpt
    if kind == "zip":
        _refuse_foreign_zip(path)
    if kind == "safetensors":  # its header parsed again from the file the data is read from
        return _open_safetensors(path)
    if path.suffix not in PICKLE_SUFFIXES:
        raise InputError(
            path,
            f"this is a torch pickle ({kind}) but is named {path.suffix or 'without a suffix'}; "
            "pickles are only read from .pt/.pth/.bin files",
        )
    return _open_pickle(path, kind)


def sniff(path: Path) -> tuple[str, Header | None]:
    """'safetensors' (with its header), 'zip' (modern torch.save), 'pickle' (legacy) or 'gguf'
    (llama.cpp), from the content.

    A file that passes the strict safetensors validation is safetensors, whatever its name or
    first byte (a header length of 0x80 mod 256 starts like a pickle's PROTO opcode); the
    zip signature cannot begin a valid safetensors file (its length would be over the cap).
    """
    with open_regular(path) as f:
        head = f.read(8)
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "zip", None
    if head.startswith(b"GGUF"):  # its u64 would be a header length over safetensors' cap
        return "gguf", None
    try:
        return "safetensors", read_header(path)
    except HeaderError:
        if head[:1] == b"\x80" and path.suffix in PICKLE_SUFFIXES:
            return "pickle", None
        if path.suffix in PICKLE_SUFFIXES:
            what = describe_non_checkpoint(path)
            if what is None:
                raise InputError(path, "not a torch checkpoint nor a safetensors file") from None
            raise InputError(path, f"not a checkpoint: {what}") from None
    return "safetensors", None  # the safetensors reader says what is wrong with it


def _refuse_foreign_zip(path: Path) -> None:
    """A zip that torch.save did not write (a numpy .npz, say) is named for what it is."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # _check_zip reports the damage
    if any(n.endswith("data.pkl") for n in names):
        return
    what = "a numpy .npz archive" if names and all(n.endswith(".npy") for n in names) else (
        "a zip archive that torch.save did not write")  # fmt: skip
    raise InputError(path, f"not a checkpoint: {what}, which qtool does not read; convert it "
                     "to .safetensors (safetensors.numpy.save_file)")  # fmt: skip


def _check_regular_file(path: Path) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputError(path, "no such file; check the path") from None
    except OSError as err:
        raise InputError(path, f"cannot read: {err.strerror}") from None
    if not os.path.isfile(path):
        raise InputError(path, "not a regular file; give a checkpoint file")
    if not os.access(path, os.R_OK) or st.st_mode & 0o444 == 0:
        raise InputError(path, "permission denied; check the file's permissions")


def open_safetensors(path: Path) -> Checkpoint:
    """A .safetensors file opened as one, whatever its content now (never sniffed as a pickle
    or GGUF: for a caller that checked it was safetensors and reads it again)."""
    return _open_safetensors(path)


def _open_safetensors(path: Path) -> Checkpoint:
    with open_regular(path) as f:
        try:
            return _adopted(path, f)
        except HeaderError as err:
            raise InputError(path, not_safetensors_message(path, err)) from None
        except OSError as err:
            raise InputError(path, f"cannot read: {err.strerror}") from None


def _open_within(path: Path, within: InputDir) -> Checkpoint:
    with within.open(path.name) as f:
        try:
            return _adopted(path, f)
        except HeaderError as err:
            f.seek(0)
            what = describe_head(f.read(64))
            message = f"not a valid safetensors file: {err}" if what is None else (
                f"not a checkpoint: {what}; give a .safetensors file")  # fmt: skip
            raise InputError(path, message) from None
        except OSError as err:
            raise InputError(path, f"cannot read: {err.strerror}") from None


def _adopted(path: Path, f: BinaryIO) -> Checkpoint:
    """A safetensors Checkpoint reading through (a duplicate of) the open file `f`, its header
    parsed through `f` once the stamp check_unchanged compares was taken (a header parsed from
    another open of the path, or before the stamp, could be another file's: its offsets would
    read one tensor's bytes as another's, and no later check would see it)."""
    st = os.fstat(f.fileno())
    header = read_header_file(f)
    if st.st_size != header.data_start + header.data_bytes:
        raise ChangedError(path, "changed while reading (its size moved); run again")
    ckpt = Checkpoint(
        path,
        header.tensors,
        header.metadata,
        _data_start=header.data_start,
        _stat=stamp(st),
    )
    ckpt.adopt(os.dup(f.fileno()), lambda head: _safetensors_header(head, st.st_size))
    return ckpt


def _safetensors_header(head: bytes, size: int) -> Header | None:
    try:
        return parse_header(head[8:], size)
    except HeaderError:
        return None


def _gguf_header(head: bytes, size: int) -> Header | None:
    from qtool.io.gguf_checkpoint import as_header
    from qtool.io.gguf_header import GGUFHeaderError, NeedMore
    from qtool.io.gguf_header import parse_header as parse_gguf

    try:
        return as_header(parse_gguf(memoryview(head), size))
    except (GGUFHeaderError, NeedMore):
        return None


def _open_pickle(path: Path, kind: str) -> Checkpoint:
    if torch_version() < MIN_TORCH_FOR_PICKLES:
        raise UnsafeInputError(
            path,
            f"reading torch pickles needs torch >= 2.10 (installed {torch.__version__}, whose "
            "weights_only loader has known code-execution holes); upgrade torch or convert the "
            "file to safetensors with a trusted tool",
        )
    # One open file for the zip check and torch.load: the path could name another file (a
    # zip bomb renamed over it) by the time torch opened it again.
    with open_regular(path) as f:
        fd = f.fileno()
        opened = fstamp(fd)
        if os.pread(fd, 4, 0).startswith((b"PK\x03\x04", b"PK\x05\x06")):
            try:  # the content decides, as it does for torch.load
                _check_zip(path, f)
            except InputError:
                _check_same(path, fd, opened)  # not damaged: changed while checked
                raise
            watched = io.BufferedReader(_Watched(fd, path, opened))
            loaded = _load_pickle(path, watched, fd, opened)
        else:
            loaded = _load_pickle(path, f, fd, opened)
        _check_same(path, fd, opened)
    state, skipped = _state_dict(path, loaded)
    entries, offset = [], 0
    for name, t in state.items():
        dtype = TORCH_TO_ST.get(t.dtype)
        if dtype is None:
            raise InputError(path, f"dtype {t.dtype} cannot be stored in safetensors", name)
        nbytes = t.numel() * DTYPE_BITS[dtype] // 8
        entries.append(TensorEntry(name, dtype, tuple(t.shape), offset, offset + nbytes))
        offset += nbytes
    return Checkpoint(path, tuple(entries), None, skipped, _tensors=state, _stat=opened)


def _check_same(path: Path, fd: int, opened: FileStamp) -> None:
    if fstamp(fd) != opened:
        raise ChangedError(path, CHANGED)


class _Watched(io.RawIOBase):
    """The zip `fd` as torch.load reads it: each read is checked against the stamp the zip check
    saw, so bytes rewritten in place after the check (compressed members, a zip bomb) are
    refused before torch decompresses them (a write moves the ctime before its data lands)."""

    def __init__(self, fd: int, path: Path, opened: FileStamp) -> None:
        super().__init__()
        self._fd, self._path, self._opened, self._pos = fd, path, opened, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._opened[2]}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = os.preadv(self._fd, [view], self._pos)
        _check_same(self._path, self._fd, self._opened)
        self._pos += n
        return n


def torch_version() -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def _check_zip(path: Path, f: BinaryIO) -> None:
    """Refuse compressed or oversized members of the open zip `f` before torch decompresses
    anything."""
    try:
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise InputError(
            path, f"corrupt or truncated torch archive ({err}); re-export it"
        ) from None
    if len(infos) > 1_000_000:
        raise UnsafeInputError(path, f"archive has {len(infos)} members; refusing to read it")
    if any(_is_torchscript_member(i.filename) for i in infos):
        raise InputError(
            path,
            "this is a TorchScript archive (torch.jit.save), not a state dict; "
            "save model.state_dict() with torch.save instead",
        )
    size = os.fstat(f.fileno()).st_size
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise UnsafeInputError(
                path,
                f"archive member {info.filename!r} is compressed, which torch.save never does "
                "(a zip-bomb pattern); refusing to read it",
            )
    if sum(i.file_size for i in infos) > size:
        raise UnsafeInputError(path, "archive members claim more bytes than the file holds")


def _is_torchscript_member(name: str) -> bool:
    """torch.jit.save stores the model's code and constants; torch.save never does."""
    parts = name.split("/")
    return len(parts) >= 2 and (parts[1] == "code" or parts[1] == "constants.pkl")


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def _load_pickle(path: Path, f: BinaryIO, fd: int, opened: FileStamp) -> object:
    """The pickle's objects from `f` (`path` open as `fd`, stamped `opened`), its tensors read
    into memory qtool owns: never mapped (mmap=True kept the zip's storages mapped, and a file
    truncated under the run killed it with SIGBUS when a tensor was read)."""
    try:
        return torch.load(f, map_location="cpu", weights_only=True, mmap=False)
    except Exception as err:  # the unpickler raises anything on corrupt input (pytorch#127525)
        _check_same(path, fd, opened)  # a file changed under the load is not corrupt
        text = str(err)
        if "Weights only load failed" in text or "Unsupported" in text:
            found = _GLOBAL_RE.search(text)
            what = f" '{found.group(1)}'" if found else ""
            raise UnsafeInputError(
                path,
                f"refused: the pickle asks for{what}, which a plain state dict never needs "
                "(nothing was run); export the weights as safetensors with a trusted tool",
            ) from None
        if isinstance(err, MemoryError) or "can't allocate memory" in text:
            raise InputError(
                path, f"a torch pickle is read whole, and its {opened[2]:,} bytes do not fit "
                "in the memory qtool may use; free memory or raise the limit",
            ) from None  # fmt: skip
        if "TorchScript" in text:
            raise InputError(
                path, "TorchScript archives are not supported; save a state_dict"
            ) from None
        first = text.strip().splitlines()[0] if text.strip() else ""
        raise InputError(
            path, f"corrupt checkpoint ({type(err).__name__}: {first[:200]}); re-export it"
        ) from None


def _state_dict(path: Path, loaded: object) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The flat name -> tensor dict inside a loaded pickle (also {"state_dict": {...}} wrappers)."""
    if not isinstance(loaded, dict):
        raise InputError(
            path, f"expected a state dict (name -> tensor), found a {type(loaded).__name__}"
        )
    if not any(isinstance(v, torch.Tensor) for v in loaded.values()):
        for key in STATE_DICT_KEYS:
            if isinstance(loaded.get(key), dict):
                return _state_dict(path, loaded[key])
        raise InputError(
            path,
            "no tensors at the top level nor under "
            + "/".join(repr(k) for k in STATE_DICT_KEYS)
            + "; save the model's state_dict()",
        )
    state: dict[str, torch.Tensor] = {}
    skipped = []
    for key, value in loaded.items():
        if not isinstance(value, torch.Tensor):
            skipped.append(str(key))
            continue
        if not isinstance(key, str):
            raise InputError(path, f"tensor key {key!r} is not a string")
        _check_tensor_name(path, key)
        _check_plain_tensor(path, key, value)
        state[key] = value.detach()  # nn.Parameter / requires_grad: ordinary weights here
    _check_claimed_bytes(path, state)
    return state, skipped


def _check_tensor_name(path: Path, name: str) -> None:
    """Names a safetensors output can hold: UTF-8 text, and not the reserved metadata key."""
    if name == "__metadata__":
        raise InputError(
            path,
            "a tensor named '__metadata__' cannot be written (safetensors reserves the "
            "name for metadata); rename it",
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(
            path, f"tensor name {name!r} holds a lone surrogate (not UTF-8 text); rename it"
        ) from None


def _check_claimed_bytes(path: Path, state: dict[str, torch.Tensor]) -> None:
    """Refuse views that claim far more bytes than the file stores, before any is materialised."""
    storages: dict[int, int] = {}
    claimed = 0
    for t in state.values():
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    stored = sum(storages.values())
    allowed = max(MAX_CLAIM_RATIO * stored, MIN_CLAIM_BYTES)
    for name, t in state.items():
        claimed += t.numel() * t.element_size()
        if claimed > allowed:
            raise UnsafeInputError(
                path,
                f"its tensors claim {claimed:,} bytes (so far) but the file stores {stored:,}: "
                f"expanded (stride-0) or repeated views, over the {MAX_CLAIM_RATIO}x / 1 GiB "
                "limit; refusing to expand them (save real tensors, e.g. t.contiguous().clone())",
                name,
            )


def _check_plain_tensor(path: Path, name: str, t: torch.Tensor) -> None:
    if t.layout != torch.strided:
        raise InputError(path, f"unsupported tensor layout {t.layout}; densify it first", name)
    if t.is_quantized or t.is_meta or t.device.type != "cpu":
        raise InputError(path, "unsupported tensor (quantized, meta or not on CPU)", name)
