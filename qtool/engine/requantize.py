"""`quantize --allow-requantize`: an already quantized GGUF quantized again, as llama-quantize's
`--allow-requantize` does. The input is dequantized to a float GGUF (F32, ggml's compute type,
so the codes are restored exactly) in a scratch directory beside the output, and that file is
quantized as any float GGUF is; the scratch directory is removed on exit, and by the next run
in that directory after a kill (it is named and locked as a temp directory, io/tempdirs.py).
A plain dry run plans from the input's headers, each quantized tensor as the F32 it becomes,
and writes nothing; --estimate reads the values, so it goes through the copy as the run does.

Quality is lost twice (the first codes' error, then the second's): the caller warns.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from qtool.engine.job import Mode, RunOptions
from qtool.engine.plan import QuantizeOptions, quantized_output
from qtool.engine.run import output_label
from qtool.engine.run import quantize as quantize_float
from qtool.errors import OutputError, QtoolError, UsageError
from qtool.formats.detect import detect
from qtool.formats.registry import entry
from qtool.gguf_types import GGML_TYPES
from qtool.io import tempdirs
from qtool.io.atomic import describe_os_error, preflight, remove_stale_temps
from qtool.io.gguf_file import GGUFFile
from qtool.io.gguf_layout import tensor_nbytes
from qtool.results import QuantizeRow, QuantizeSummary
from qtool.spec import GGUF_QUANTIZE_TYPES, FormatName

_FLOAT_NAME = "requantize.F32.gguf"


def quantized_gguf(src: Path) -> str | None:
    """What `src` is when it is an already quantized GGUF file (e.g. 'a GGUF file (Q4_1)'),
    else None (a float GGUF, or any other checkpoint: quantized as usual)."""
    found = detect(src)
    if found.format != FormatName.GGUF or not found.quantized:
        return None
    return found.description


def requantize(
    src: Path, out: Path | None, options: QuantizeOptions, run: RunOptions
) -> QuantizeSummary:
    """Quantize `src` as `engine.run.quantize` does; an already quantized GGUF is dequantized
    into a scratch directory beside the output first, except for a plan (from its headers,
    nothing written). UsageError for another output format than GGUF, OutputError for an
    output that is the input; the rows describe the input (its types and bytes)."""
    if quantized_gguf(src) is None:
        return quantize_float(src, out, options, run)
    if options.format != FormatName.GGUF:
        raise UsageError(
            src, "a quantized GGUF is quantized again only into a GGUF", hint="format-gguf"
        )
    target = quantized_output(src, out, output_label(options), entry(options.format).suffix)
    if _same_file(target, src):  # as atomic.preflight says it, for a path it cannot compare
        raise OutputError(target, f"would overwrite the input {src}; choose another output path")
    # Every check the second run makes on its output, before the long dequantize: a refusal
    # there would come after the F32 copy was written (or after it filled the disk).
    protected = [src, *options.input_files]
    preflight([target, *run.also], protected, force=run.force, needed_bytes=_needed_bytes(src))
    if run.mode is Mode.PLAN:  # planned from the input's headers, as the copy's: no copy
        summary = quantize_float(src, target, options, run, requantize=True)
        return replace(summary, rows=_as_input(summary.rows, src))
    from qtool.engine.restore import dequantize  # torch

    with scratch_beside(target) as scratch:
        float_gguf = scratch / _FLOAT_NAME
        try:
            dequantize(src, float_gguf, progress=run.progress)
            summary = quantize_float(float_gguf, target, options, run)
        except QtoolError as err:
            raise _named_for_user(err, float_gguf, src) from None
    return replace(summary, inputs=[str(src)], rows=_as_input(summary.rows, src))


def _as_input(rows: list[QuantizeRow], src: Path) -> list[QuantizeRow]:
    """The rows with the input's own types and bytes, where the run counted each quantized
    tensor as the F32 it dequantizes to (the copy's, or the plan's float header)."""
    with GGUFFile(src) as f:
        infos = f.header.by_name()
    out = []
    for row in rows:
        info = infos.get(row.name)
        out.append(
            row if info is None else replace(row, dtype=info.type.name, bytes_in=info.nbytes)
        )
    return out


def _same_file(out: Path, src: Path) -> bool:
    if out.resolve() == src.resolve():
        return True
    with contextlib.suppress(OSError):
        return out.samefile(src)
    return False


def _needed_bytes(src: Path) -> int:
    """At least the free space the run takes beside its output: the F32 copy's tensors (a
    quantized one as F32, a plain one as it is) and the output's at the fewest bits per weight
    of any type qtool writes (the output's own plan needs the copy's headers; the second run
    checks it again, exactly, with the copy written)."""
    f32 = GGML_TYPES["F32"]
    fewest = min(GGML_TYPES[t].bits_per_weight for t in GGUF_QUANTIZE_TYPES)
    with GGUFFile(src) as f:
        tensors = f.header.tensors
    copy = out = 0
    for info in tensors:
        plain = info.type.block_size == 1  # F32, F16, BF16, F64, I8-I64: not quantized
        copy += info.nbytes if plain else tensor_nbytes(f32, info.shape)
        out += info.nbytes if plain and len(info.shape) < 2 else int(info.numel * fewest) // 8
    return copy + out


def _named_for_user(err: QtoolError, scratch_file: Path, src: Path) -> QtoolError:
    """The error as the user's files name it, not the scratch file: a problem found reading
    the copy is the input's; one writing it names the directory it was written in, as
    qtool's temporary copy (an error about the output names the output already)."""
    if err.path != str(scratch_file):
        return err
    if isinstance(err, OutputError):
        err.path = os.path.abspath(scratch_file.parent.parent)
        err.message = f"writing qtool's temporary F32 copy of the input here: {err.message}"
    else:
        err.path = str(src)
    return err


@contextlib.contextmanager
def scratch_beside(out: Path) -> Iterator[Path]:
    """A new directory `.<OUT>.qtool-tmp-<pid>-<random>/` beside `out` (0700), locked for its
    life and removed on exit; a killed run's is removed by the next run that writes there
    (atomic.remove_stale_temps: its lock is free). OutputError when none can be made."""
    parent = out.parent
    remove_stale_temps(parent)
    scratch = parent / f".{out.name}.qtool-tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.mkdir(scratch, 0o700)
    except OSError as err:
        raise OutputError(out, f"cannot make a scratch directory beside it: "
                          f"{describe_os_error(err)}") from None  # fmt: skip
    fd = -1
    try:
        fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        tempdirs.lock_dir(fd)  # where flock fails, cleanups use the age rule instead
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if fd >= 0:
            os.close(fd)
