"""A GGUF file as float tensors (formats/base.py's FloatReader): every tensor under its GGUF name,
in torch order (GGUF's shapes reversed), dequantized on the fly to float32 exactly as
gguf.quants and ggml dequantize it. Types qtool's kernels do not cover (IQ*, TQ*, MXFP4) go
through gguf.quants when gguf is installed.

    with GGUFFloatReader(path) as r:
        r.shape("blk.0.attn_q.weight")        (576, 576)
        r.quantization(...)                   GGUFSpec Q4_K (None: stored as it is)
        r.values(...)                         torch.float32 (576, 576)
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import math
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import numpy as np
import torch

from qtool.errors import InputError, NumericError, UsageError
from qtool.formats.base import FloatReader
from qtool.formats.gguf.summary import refuse_split
from qtool.gguf_types import GGMLType
from qtool.io.gguf_file import GGUFFile
from qtool.io.gguf_layout import GGUFHeader, GGUFTensorInfo
from qtool.numerics import gguf as kernels
from qtool.spec import Codec, gguf_spec, is_gguf_name

# GGUF types stored as plain numbers -> (their dtype name, the torch dtype they read as)
PLAIN: dict[str, torch.dtype] = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
}  # fmt: skip
INSTALL_GGUF = "pip install 'qtool[gguf]'"
SLAB_BYTES = 16 << 20  # float32 values per slab of `slabs`, as engine/slabs.py reads them


class GGUFFloatReader:
    """A GGUF file read as float tensors; quantized ones count as float32 (ggml's compute
    type) and dequantize to it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        self.header: GGUFHeader = self.file.header
        try:
            refuse_split(self.path, self.header)
        except InputError:
            self.file.close()
            raise
        self._infos = self.header.by_name()

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.header.tensors]

    @property
    def metadata(self) -> dict[str, str] | None:
        """None: GGUF metadata is typed (summary.py shows it), not safetensors' strings."""
        return None

    def info(self, name: str) -> GGUFTensorInfo:
        return self._infos[name]

    def gguf_type(self, name: str) -> GGMLType:
        return self._infos[name].type

    def shape(self, name: str) -> tuple[int, ...]:
        return self._infos[name].torch_shape

    def dtype(self, name: str) -> str:
        t = self._infos[name].type.name
        return t if t in PLAIN else "F32"

    def quantization(self, name: str) -> Codec | None:
        t = self._infos[name].type
        return gguf_spec(t) if is_gguf_name(t.name) else None

    def values(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor as float (plain types as stored), in `dtype` when given. A block type's
        values are checked once: NaN/Inf (a non-finite scale or minimum) is a NumericError
        naming the tensor, and so is a cast that overflows `dtype`, never a silent NaN or -inf.
        The whole tensor in memory: `slabs` gives it a slab of rows at a time."""
        info = self._infos[name]
        with _memory(self.path, info):
            raw = np.empty(info.nbytes, dtype=np.uint8)
            self.file.read_into(info, raw)
        return self._decoded(info, raw, info.torch_shape, dtype)

    def slabs(self, name: str, dtype: torch.dtype | None = None) -> Iterator[torch.Tensor]:
        """The tensor's values as `values` gives them (and checks them), SLAB_BYTES of float32
        rows at a time: 2-D slabs of its rows (the last dimension) whose bytes, one slab after
        another, are the tensor's in C order. Memory: one slab, reused; a slab is valid until
        the next one is asked for."""
        info = self._infos[name]
        shape = info.torch_shape
        rows = math.prod(shape[:-1]) if len(shape) >= 2 else 0
        if rows < 2 or info.nbytes == 0:
            yield self.values(name, dtype)
            return
        row_bytes = info.nbytes // rows
        per = max(1, SLAB_BYTES // (shape[-1] * 4))
        with _memory(self.path, info):
            buf = np.empty(min(per, rows) * row_bytes, dtype=np.uint8)
        for start in range(0, rows, per):
            n = min(per, rows - start)
            raw = buf[: n * row_bytes]
            self.file.read_part(info, start * row_bytes, raw)
            yield self._decoded(info, raw, (n, shape[-1]), dtype)

    def _decoded(
        self,
        info: GGUFTensorInfo,
        raw: np.ndarray,
        shape: tuple[int, ...],
        dtype: torch.dtype | None,
    ) -> torch.Tensor:
        """`raw` (whole rows of the tensor) as values of `shape`, checked (see `values`)."""
        with _memory(self.path, info):
            plain = PLAIN.get(info.type.name)
            if plain is not None:
                t = torch.from_numpy(raw).view(plain).reshape(shape)
            else:
                t = self._dequantize(info, raw).reshape(shape)
                if not _finite(t):
                    raise NumericError(self.path, "its blocks hold NaN/Inf scales or minimums, "
                                       "so it dequantizes to NaN/Inf; the file is damaged",
                                       info.name)  # fmt: skip
            if dtype is None or dtype == t.dtype:
                return t
            out = t.to(dtype)
        if out.is_floating_point() and not _finite(out) and _finite(t):
            raise NumericError(self.path, f"values overflow {_dtype_name(dtype)} to infinity; "
                               "restore it as float32 (or bfloat16)", info.name,
                               hint="restore-dtype")  # fmt: skip
        return out

    def _dequantize(self, info: GGUFTensorInfo, raw: np.ndarray) -> torch.Tensor:
        """float32 rows of `raw`, whole rows of the tensor's blocks."""
        rows = raw.reshape(-1, info.type.row_bytes(info.shape[0] if info.shape else 1))
        if info.type.name in kernels.DEQUANTIZE_TYPES:
            return kernels.dequantize(torch.from_numpy(rows), info.type)
        return torch.from_numpy(_gguf_py_dequantize(self.path, info, rows))

    def raw(self, name: str) -> memoryview:
        info = self._infos[name]
        if info.type.name not in PLAIN:
            raise ValueError(f"{name!r} is {info.type.name}-quantized; read its values")
        with _memory(self.path, info):
            return self.file.tensor_bytes(info).data

    def nbytes(self, name: str) -> int:
        return self._infos[name].nbytes

    def stored_dtype(self, name: str) -> str:
        """The GGUF type name ('Q4_K'; 'F16', 'BF16', 'F32' as safetensors spells them too)."""
        return self._infos[name].type.name

    def file_of(self, name: str) -> Path:
        return self.path

    @property
    def sidecars(self) -> list[Path]:
        return []

    def restored_files(self) -> dict[str, bytes]:
        return {}

    def release(self, name: str) -> None:
        """Nothing to drop: tensors are read into buffers of their own."""

    def check_unchanged(self) -> None:
        self.file.check_unchanged()

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> GGUFFloatReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _memory(path: Path, info: GGUFTensorInfo) -> contextlib.AbstractContextManager[None]:
    """A tensor too large for the memory this process may use (a limit, or a sparse file that
    declares more than it holds): an InputError naming the file and the tensor."""
    what = f"its {info.type.name} data of {info.nbytes:,} bytes ({info.numel:,} values)"
    return out_of_memory(path, what, info.name)


@contextlib.contextmanager
def out_of_memory(path: Path | str, what: str, tensor: str) -> Iterator[None]:
    """An allocation the memory this process may use refuses (MemoryError, mmap's ENOMEM,
    torch's allocator's RuntimeError) as an InputError naming the file and the tensor: `what`
    does not fit, free memory or raise the limit. Any other error passes through."""
    try:
        yield
    except (MemoryError, OSError, RuntimeError) as err:
        if isinstance(err, OSError) and err.errno != errno.ENOMEM:
            raise
        if isinstance(err, RuntimeError) and "can't allocate memory" not in str(err):
            raise  # torch's allocator says so in a RuntimeError
        raise InputError(
            path, f"{what} does not fit in the memory qtool may use; free memory or raise the "
            "limit", tensor,
        ) from None  # fmt: skip


def _finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite (one pass: the min and max propagate NaN/Inf)."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t.reshape(-1))
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def open_gguf(path: Path) -> FloatReader:
    """A GGUF file as a FloatReader (mypy checks here that GGUFFloatReader is one)."""
    return GGUFFloatReader(path)


def _gguf_py_dequantize(path: Path, info: GGUFTensorInfo, rows: np.ndarray) -> np.ndarray:
    """gguf.quants' float32 rows of a type qtool's kernels do not cover."""
    if importlib.util.find_spec("gguf") is None:
        raise UsageError(
            path, f"qtool reads {info.type.name} tensors through the gguf package; "
            f"install it with {INSTALL_GGUF}", info.name,
        )  # fmt: skip
    from gguf import GGMLQuantizationType, quants

    try:
        qtype = GGMLQuantizationType(info.type.id)
        with np.errstate(all="ignore"):
            out = quants.dequantize(rows, qtype)
    except (NotImplementedError, ValueError) as err:
        raise InputError(path, f"cannot dequantize {info.type.name}: {err}", info.name) from None
    return np.ascontiguousarray(out, dtype=np.float32)
