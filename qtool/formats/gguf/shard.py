"""The GGUF output file of a quantize run (formats/base.py's ShardWriter), written as
llama-quantize writes one: the input's metadata with general.quantization_version and
general.file_type set and moved last (split keys dropped: writer.output_metadata), the tensors
in llama-quantize's order (plan.llama_order) at the input's alignment, each as planned: its
GGUF blocks (codes from numerics/gguf, the bytes of ggml's reference quantizers) or its input
bytes. The plan is final before the first byte (the loop's passes ran), so the header goes
first; the file is a temporary one of the run's OutputSet, renamed only when all is written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from qtool.errors import OutputError
from qtool.formats.base import Planned
from qtool.formats.gguf.ftype import FILE_TYPE_KEY, guess_ftype
from qtool.formats.gguf.plan import llama_order
from qtool.formats.gguf.writer import output_metadata
from qtool.gguf_types import GGMLType
from qtool.io.atomic import describe_os_error
from qtool.io.gguf_layout import GGUFHeader, GGUFValue
from qtool.io.gguf_write import GGUFStreamWriter, build_header
from qtool.io.stformat import TensorEntry
from qtool.spec import Codec, GGUFSpec

if TYPE_CHECKING:
    from qtool.io.atomic import OutputSet
    from qtool.numerics.kernels import QuantizedTensor

_T = TypeVar("_T")


class GGUFShardWriter:
    """Receives the run's tensors in llama-quantize's order and streams them into `out`."""

    def __init__(
        self,
        header: GGUFHeader,
        planned: Sequence[Planned],
        out: Path,
        outputs: OutputSet,
        file_type: int | None = None,
        extra: Mapping[str, GGUFValue] | None = None,
    ) -> None:
        """`file_type`: general.file_type to write (a llama.cpp mix's); else llama.cpp's guess
        from the types written. `extra`: keys written last (quantize.imatrix.*)."""
        self._out = out
        infos = header.by_name()
        by_name = {p.entry.name: p for p in planned}
        names = llama_order(list(by_name))
        self.order: list[TensorEntry] = [by_name[n].entry for n in names]
        types = {n: _stored(by_name[n].spec, infos[n].type) for n in names}
        quantized = [types[n].name for n in names if by_name[n].spec is not None]
        before = header.metadata.get(FILE_TYPE_KEY)
        if file_type is None:
            file_type = guess_ftype(quantized) if quantized else _int(before)
        specs = [(n, types[n], infos[n].shape) for n in names]
        raw, layout = build_header(output_metadata(header, file_type, extra), specs)
        self._stream = self._guard(lambda: GGUFStreamWriter(outputs.create(out), raw, layout))

    def keep(self, entry: TensorEntry, data: memoryview) -> None:
        self._guard(lambda: self._stream.write(data))

    def quantized(self, entry: TensorEntry, spec: Codec, result: QuantizedTensor) -> None:
        codes = result.q.cpu().contiguous().numpy()
        self._guard(lambda: self._stream.write(codes))

    def finish(self) -> None:
        self._stream.finish()

    def _guard(self, write: Callable[[], _T]) -> _T:
        """`write()`, a failed write (a full disk) an OutputError naming the output."""
        try:
            return write()
        except OSError as err:
            raise OutputError(self._out, f"cannot write: {describe_os_error(err)}") from None


def _stored(spec: Codec | None, own: GGMLType) -> GGMLType:
    """The tensor's type in the output: the (fitted) spec's, or its own when kept."""
    return spec.gguf if isinstance(spec, GGUFSpec) else own


def _int(value: object) -> int | None:
    v = getattr(value, "value", None)
    return v if isinstance(v, int) and not isinstance(v, bool) else None
