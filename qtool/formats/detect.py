"""What a path holds: `detect(path)`, the one answer every command starts from (torch-free).

Each format registers its detectors by name (formats/registry.py loads the formats); `detect`
asks them in the order of PRIORITY, the one table of every detector's place, and the first that
recognises the path answers.

A directory's config.json is read once, by the one bounded, regular-file-only reader: a FIFO,
`/dev/zero`, a file nested too deep or too big there is an error naming config.json, never "no
checkpoint here". A new format registers one more detector, with its priority when it is not
in the table (a number between those it must come after and before).

Header detectors are the per-file check the quantize loop runs on each shard: a checkpoint
that is already quantized is never quantized again (codes of codes).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.errors import InputError
from qtool.formats import builtins

if TYPE_CHECKING:  # the readers are imported when a path is probed: registering imports none
    from qtool.io.index import ShardedInput
    from qtool.io.safeopen import InputDir
    from qtool.io.stformat import Header

CONFIG = "config.json"
SAFETENSORS = ".safetensors"


@dataclass(frozen=True)
class Detected:
    """What `detect` found at `path`.

    `format` names the registered format that reads it; `weights` are its weight files in
    order (a lone file: itself); `directory` is the model or checkpoint directory (None: a lone
    file), held open as `within`; `index` its validated index (None: no index); `config` its
    config.json, parsed (None: there is none)."""

    path: Path
    kind: str
    format: str
    description: str
    quantized: bool
    weights: tuple[Path, ...]
    directory: Path | None = None
    index: ShardedInput | None = field(default=None, repr=False)
    within: InputDir | None = field(default=None, repr=False, compare=False)
    config: object = field(default=None, repr=False, compare=False)
    header: Header | None = field(default=None, repr=False, compare=False)
    """A lone safetensors file's header, as detect read it (a 50,000-tensor header costs a
    second to parse: the planner takes it from here)."""

    @property
    def named(self) -> Path:
        """What messages and summaries name: the index, the model directory, or the file."""
        if self.index is not None:
            return self.index.index
        return self.directory if self.directory is not None else self.path

    @property
    def config_path(self) -> Path | None:
        """Where config.json lies (None: not a directory)."""
        return self.directory / CONFIG if self.directory is not None else None


class Probe:
    """What a detector may look at, each read at most once: the path and, for a directory (or
    an index or config.json in one), its entries through one descriptor, its config.json, its
    index; for a file, its safetensors header."""

    def __init__(self, path: Path) -> None:
        from qtool.io.index import INDEX_SUFFIX

        self.path = path
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise InputError(path, "no such file or directory; check the path") from None
        except OSError as err:
            raise InputError(path, f"cannot read: {err.strerror or err}") from None
        self.is_dir = stat.S_ISDIR(st.st_mode)
        self.index_file = not self.is_dir and path.name.endswith(INDEX_SUFFIX)
        inside = self.index_file or (not self.is_dir and path.name == CONFIG)
        self.directory: Path | None = path if self.is_dir else (path.parent if inside else None)

    @property
    def checkpoint_dir(self) -> bool:
        """The path names a checkpoint directory: the directory itself, or its index."""
        return self.is_dir or self.index_file

    @cached_property
    def within(self) -> InputDir | None:
        """The directory, opened once (None: a lone file)."""
        from qtool.io.safeopen import InputDir

        return InputDir(self.directory) if self.directory is not None else None

    @cached_property
    def names(self) -> list[str]:
        return self.within.names() if self.within is not None else []

    @cached_property
    def config(self) -> object:
        """The directory's config.json, parsed (None: there is none); InputError naming it when
        it cannot be read (not a regular file, too big, too deep, not JSON)."""
        from qtool.io.jsonfile import read_json

        if self.within is None or not self.within.exists(CONFIG):
            return None
        assert self.directory is not None
        return read_json(self.directory / CONFIG, within=self.within, what=CONFIG)

    @cached_property
    def index_name(self) -> str | None:
        """The index named, or the one index in the directory (None: none); InputError when a
        directory holds several."""
        from qtool.io.index import INDEX_SUFFIX

        if not self.is_dir:
            return self.path.name if self.path.name.endswith(INDEX_SUFFIX) else None
        within = self.within
        assert within is not None
        found = [n for n in self.names if n.endswith(INDEX_SUFFIX) and not within.is_dir(n)]
        if len(found) > 1:
            raise InputError(
                self.path,
                f"{len(found)} *{INDEX_SUFFIX} files in this directory; give the index file itself",
            )
        return found[0] if found else None

    @cached_property
    def sharded(self) -> ShardedInput | None:
        """The validated index and shards (None: no index)."""
        from qtool.io.index import load_index

        if self.index_name is None:
            return None
        if not self.is_dir:
            return load_index(self.path)  # the index you name is read by its path
        assert self.within is not None and self.directory is not None
        return load_index(self.directory / self.index_name, self.within)

    def safetensors_files(self) -> list[str]:
        """The directory's *.safetensors entries (sorted), but not directories so named (an
        `extra.safetensors/` beside the model is no second checkpoint file)."""
        within = self.within
        if not self.is_dir or within is None:
            return []
        return [n for n in self.names if n.endswith(SAFETENSORS) and not within.is_dir(n)]

    @cached_property
    def header(self) -> Header | None:
        """A lone file's safetensors header (None: not a safetensors file, or unreadable: its
        reader says why)."""
        from qtool.io.stformat import HeaderError, read_header

        if self.is_dir or self.directory is not None:
            return None
        try:
            return read_header(self.path)
        except (HeaderError, InputError, OSError):
            return None

    def header_of(self, name: str) -> Header | None:
        """The header of the file `name` in the directory (None: not safetensors)."""
        from qtool.io.stformat import HeaderError, read_header_file

        assert self.within is not None
        try:
            with self.within.open(name) as f:
                return read_header_file(f)
        except HeaderError:
            return None

    def as_file(self, kind: str, fmt: str, description: str, *, quantized: bool) -> Detected:
        """The path as a lone file."""
        return Detected(
            self.path, kind, fmt, description, quantized, (self.path,), header=self.header
        )

    def as_directory(
        self,
        kind: str,
        fmt: str,
        description: str,
        *,
        quantized: bool,
        weights: Sequence[str] | None = None,
    ) -> Detected:
        """The path as a checkpoint directory: its `weights` (None: the index's shards)."""
        assert self.directory is not None
        sharded = self.sharded if weights is None else None
        within = sharded.within if sharded is not None else self.within
        names = sharded.shards if sharded is not None else list(weights or ())
        return Detected(
            self.path, kind, fmt, description, quantized,
            tuple(self.directory / n for n in names), self.directory, sharded, within,
            self.config,
        )  # fmt: skip


PRIORITY = {
    # a lone file starting with QTLOGITS: eval --save-logits's (formats/eval_logits.py)
    "qtool-logits": 5,
    # a safetensors file whose metadata holds a qparams manifest
    "qtool-sidecar": 10,
    # a safetensors file whose metadata binds it to a sidecar
    "qtool-file": 20,
    # a lone file starting with llama.cpp's GGUF magic, or named *.gguf
    "gguf": 25,
    # a model directory (or its index or config.json) whose config.json has a
    # compressed-tensors quantization_config
    "compressed-tensors": 30,
    # a lone safetensors file holding *.weight_packed / *.weight_scale (a shard out of its
    # directory: read only through that directory)
    "compressed-tensors-file": 35,
    # a directory (or index) of qtool-quantized files: an index with a `qtool` section, or
    # weight files that are qtool-quantized
    "qtool-directory": 40,
    # an index file, or a directory holding exactly one index
    "sharded": 50,
    # a directory with one *.safetensors file and no index
    "model-directory": 60,
    # any other file (.safetensors, .pt, .pth, .bin; its reader says what is wrong with
    # anything else)
    "checkpoint": 70,
}
"""Every built-in detector's place in the order `detect` asks them (lower first)."""

Detector = Callable[[Probe], Detected | None]
_DETECTORS: list[tuple[int, str, Detector]] = []


def register(name: str, detector: Detector, priority: int | None = None) -> None:
    """Add the detector `name` at its place in PRIORITY (or at `priority`, for a detector the
    table does not hold); ValueError for a name registered twice or placed nowhere."""
    if any(n == name for _, n, _ in _DETECTORS):
        raise ValueError(f"detector {name!r} is registered already")
    place = PRIORITY.get(name) if priority is None else priority
    if place is None:
        raise ValueError(f"detector {name!r} has no priority: give one, or add it to PRIORITY")
    _DETECTORS.append((place, name, detector))
    _DETECTORS.sort(key=lambda d: d[0])


def detect(path: Path) -> Detected:
    """What `path` holds (see the module docstring); InputError when nothing recognises it."""
    from qtool.io.index import INDEX_SUFFIX

    builtins.load()
    probe = Probe(path)
    for _, _, detector in _DETECTORS:
        found = detector(probe)
        if found is not None:
            return found
    raise InputError(
        path,
        f"no checkpoint in this directory: no *{INDEX_SUFFIX} file and not exactly one "
        f"*{SAFETENSORS} file ({len(probe.safetensors_files())} found); give a file or an index",
    )


# ---------------------------------------------------------------- per-file checks


@dataclass(frozen=True)
class HeaderView:
    """What a header detector may look at: a checkpoint file's path, metadata, tensor names."""

    path: Path
    metadata: dict[str, str]
    names: Sequence[str]


HeaderDetector = Callable[[HeaderView], str | None]
_HEADER_DETECTORS: list[HeaderDetector] = []


def register_header(detector: HeaderDetector) -> None:
    """Add a check that names the quantized format a checkpoint file is already in."""
    _HEADER_DETECTORS.append(detector)


def quantized_format(view: HeaderView) -> str | None:
    """The quantized format the file is in, or None for a plain (float) checkpoint."""
    builtins.load()
    return next((found for d in _HEADER_DETECTORS if (found := d(view)) is not None), None)


def refuse_quantized(path: Path, metadata: dict[str, str] | None, names: Sequence[str]) -> None:
    """InputError when `path` is already quantized (or is a sidecar)."""
    found = quantized_format(HeaderView(path, metadata or {}, names))
    if found is not None:
        raise already_quantized(path, found)


def already_quantized(path: Path, what: str, float_suffix: str = "") -> InputError:
    """`float_suffix`: dequantize writes a float file of the input's own format when its
    output is named so (a GGUF's float GGUF), which quantize takes again."""
    own = f", in this format when its output ends in {float_suffix}" if float_suffix else ""
    return InputError(
        path,
        f"is {what}, not a float checkpoint: it holds already quantized data, and "
        "quantizing it again would store codes of codes; quantize the original float "
        f"checkpoint (if it is lost, qtool dequantize makes a float copy{own})",
    )
