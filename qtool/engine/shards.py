"""The shards of a run's source as the planner and the loop read them: each shard's tensor list
(from its header, or from the loaded pickle), then its checkpoint, opened once and closed when
its tensors are written. Torch is imported only when a checkpoint is opened: a dry run of
safetensors files reads headers alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.engine.source import Source
from qtool.formats.detect import refuse_quantized
from qtool.io.stformat import HeaderError, TensorEntry

if TYPE_CHECKING:
    from qtool.io.checkpoint import Checkpoint


class Shards:
    """The shards of `source`, opened one at a time as the run reaches them (a torch pickle
    must be loaded to be listed; it is loaded once). `header_only`: list a safetensors file
    from its header even when it is not sharded (a dry run reads no data)."""

    def __init__(self, source: Source, *, header_only: bool = False) -> None:
        self.source = source
        self._header_only = header_only
        self._open: dict[Path, Checkpoint] = {}
        self._skipped: list[str] = []

    def headers(self) -> Iterator[tuple[Path, tuple[TensorEntry, ...]]]:
        """Each shard with its tensors, in order; InputError for an already quantized file."""
        for shard in self.source.shards:
            entries, metadata = self._entries(shard)
            refuse_quantized(shard, metadata, [e.name for e in entries])
            yield shard, entries

    def checkpoint(self, shard: Path) -> Checkpoint:
        """The shard's checkpoint, opened on first use and kept open until `done`."""
        if shard not in self._open:
            self._open[shard] = self.source.checkpoint(shard)
        return self._open[shard]

    def done(self, shard: Path) -> None:
        """Close a shard whose tensors are all written (its non-tensor entries are noted)."""
        ckpt = self._open.pop(shard, None)
        if ckpt is not None:
            self._skipped += ckpt.skipped
            ckpt.close()

    def close(self) -> None:
        for shard in list(self._open):
            self.done(shard)

    @property
    def skipped(self) -> list[str]:
        """Non-tensor entries of the pickles read so far (and still open)."""
        return self._skipped + [s for ckpt in self._open.values() for s in ckpt.skipped]

    def _entries(self, shard: Path) -> tuple[tuple[TensorEntry, ...], dict[str, str] | None]:
        # shards of a sharded checkpoint are safetensors, validated with their index
        if self.source.index is not None or (self._header_only and shard.is_file()):
            try:
                header = self.source.header(shard)
                return header.tensors, header.metadata
            except HeaderError:
                if self.source.index is not None:
                    raise
                # a pickle, or a broken file: opening it loads it, or says what is wrong
        ckpt = self.checkpoint(shard)
        return ckpt.entries, ckpt.metadata
