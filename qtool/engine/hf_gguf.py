"""`quantize HF_DIR --format gguf`: a Hugging Face model directory of the Llama family (Llama,
Mistral, Qwen2) converted to a float GGUF as llama.cpp's convert_hf_to_gguf.py writes it
(formats/gguf/hf_export.py), in a scratch directory beside the output, and that file quantized
as any float GGUF is (the llama.cpp way: convert, then llama-quantize). The scratch directory
is removed on exit, and by the next run in that directory after a kill (engine/requantize.py's
scratch_beside). The float copy is in the checkpoint's own 16-bit type (the converter's auto:
BF16 for a BF16 checkpoint), so the quantizers see the checkpoint's values exactly. A dry
run's plan writes nothing: the conversion's checks, then its header alone in a memory file.

The conversion (and gguf-py's SpecialVocab in it, which opens files by path) never reads the
user's directory: it reads a private copy of the files it takes (checked_model), each read once
through the directory's descriptor, as docs/reliability.md's "Reading a model directory" says.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from qtool.engine.job import Mode, RunOptions
from qtool.engine.model.checked import MAX_TOKENIZER_BYTES, MAX_TOKENIZER_TOTAL, private_dir
from qtool.engine.plan import QuantizeOptions, quantized_output
from qtool.engine.requantize import scratch_beside
from qtool.engine.run import output_label
from qtool.engine.run import quantize as quantize_float
from qtool.engine.source import protected_paths
from qtool.errors import ChangedError, InputError, OutputError, QtoolError, UsageError
from qtool.formats.registry import entry
from qtool.io.atomic import OutputSet, preflight
from qtool.io.filestamp import FileStamp, fstamp
from qtool.io.gguf_layout import GGUFHeader
from qtool.io.outcheck import refuse_nesting
from qtool.io.safeopen import InputDir, Refused, read_limited
from qtool.results import QuantizeRow, QuantizeSummary

_FLOAT_NAME = "converted.gguf"
READ_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "added_tokens.json", "chat_template.jinja", "chat_template.json", "merges.txt",
              "README.md", "generation_config.json")  # fmt: skip
"""The files of a model directory the conversion reads besides its .safetensors weights and
additional_chat_templates/*.jinja: gguf-py's SpecialVocab reads the tokenizer's, its Metadata
the model card (README.md) and generation_config.json."""
TEMPLATES = "additional_chat_templates"


def converts(src: Path, options: QuantizeOptions) -> bool:
    """Whether this run converts `src` first: a model directory the output format converts
    into its own input (GGUF: formats/gguf/hf_export.py), or any input when the spec is a float
    type (F16: the conversion is the whole run; write_float refuses what it cannot convert)."""
    if float_type(options) is not None:
        return True
    found = entry(options.format.value).converts
    return found is not None and bool(found(src))


def float_type(options: QuantizeOptions) -> str | None:
    """The float type a run's spec stores (F32, F16, BF16: a conversion, no codes), or None."""
    return options.spec.stored_dtype() if options.spec.conversion else None


def quantize_hf(
    src: Path, out: Path | None, options: QuantizeOptions, run: RunOptions
) -> QuantizeSummary:
    """Convert the model directory `src` to a float GGUF beside the output, then quantize that
    as engine.run.quantize does; the summary names `src` as the input. A float spec (F16) writes
    the float GGUF itself (write_float)."""
    if float_type(options) is not None:
        return write_float(src, out, options, run)
    target = quantized_output(src, out, output_label(options), entry(options.format).suffix)
    refuse_nesting(target, [src])  # a new file in the model's directory changes the model
    needed, data = _weights_bytes(src)
    protected = [*read_files(src), *options.input_files]
    for p in run.also:  # a new file in the model's directory changes the model
        refuse_nesting(p, [src])
    preflight([target, *run.also], protected, force=run.force, needed_bytes=needed)
    _within_file_size_limit(data // 2, target)
    convert = entry(options.format.value).convert
    assert convert is not None  # converts() said so
    if run.mode is Mode.PLAN and hasattr(os, "memfd_create"):
        return _plan(src, target, options, run, convert)
    with scratch_beside(target) as scratch:
        float_gguf = scratch / _FLOAT_NAME
        try:
            with OutputSet() as outputs, checked_model(src) as copy:
                converted = convert(copy, float_gguf, outputs)
                outputs.commit()
            summary = quantize_float(float_gguf, target, options, run)
        except QtoolError as err:
            raise _named_for_user(err, float_gguf, src) from None
    sources: dict[str, tuple[str, int]] = getattr(converted, "sources", {})
    return replace(summary, inputs=[str(src)], rows=_as_checkpoint(summary.rows, sources))


def _plan(
    src: Path, target: Path, options: QuantizeOptions, run: RunOptions,
    convert: Callable[..., object],
) -> QuantizeSummary:  # fmt: skip
    """A dry run's plan: every check the conversion makes, then the float GGUF's header alone
    in a memory file (its data a hole never read), planned as the real run plans the copy;
    nothing is written to disk and no value is read."""
    fd = os.memfd_create("qtool-plan", os.MFD_CLOEXEC)
    header = Path(f"/proc/self/fd/{fd}")
    try:
        with checked_model(src) as copy:
            converted = convert(copy, header, None, None, True)
        summary = quantize_float(header, target, options, run)
    except OutputError as err:
        if err.path == str(header):  # the memory file: no directory of the user's to name
            err.path, err.message = None, _in_memory(err.message, "the model's float copy")
        raise
    except QtoolError as err:
        raise _named_for_user(err, header, src) from None
    finally:
        os.close(fd)
    sources: dict[str, tuple[str, int]] = getattr(converted, "sources", {})
    return replace(summary, inputs=[str(src)], rows=_as_checkpoint(summary.rows, sources))


def _as_checkpoint(
    rows: list[QuantizeRow], sources: dict[str, tuple[str, int]]
) -> list[QuantizeRow]:
    """Each row's input dtype and size as the checkpoint holds the tensor, not as the scratch
    copy did (an F32 checkpoint's F16 copy is half its size); a tensor the conversion made
    (llama3's rope_freqs) keeps the copy's. A tensor kept in another type than the checkpoint's
    says why: the format saw only the copy, where it was already F32 (a norm) or F16."""
    out = []
    for r in rows:
        if r.name not in sources:
            out.append(r)
            continue
        dtype, nbytes = sources[r.name]
        detail = r.detail
        if not r.quantized and dtype != r.out_dtype:
            detail = f"{detail}; {_retyped(dtype, r.out_dtype, r.shape)}"
        out.append(replace(r, dtype=dtype, bytes_in=nbytes, detail=detail))
    return out


def _retyped(dtype: str, written: str, shape: tuple[int, ...]) -> str:
    """Why a kept tensor is written in another float type than the checkpoint's: the converter
    writes 1-D tensors and norms F32, the others in its --outtype auto (F16 for F32 weights)."""
    if written == "F32" and len(shape) <= 1:
        return f"{dtype} widened to F32, as convert_hf_to_gguf.py writes 1-D tensors"
    return f"{dtype} written {written}, as convert_hf_to_gguf.py's --outtype auto converts it"


def read_files(src: Path) -> list[Path]:
    """The directory and every file in it the conversion may read (weights, index, config,
    tokenizer files, chat templates), links resolved by preflight's device-and-inode check: no
    output may replace one (a weight file linked from elsewhere is the user's weights)."""
    templates = src / "additional_chat_templates"
    found = [p for p in src.iterdir() if not p.is_dir()]
    if templates.is_dir():
        found += [p for p in templates.iterdir() if not p.is_dir()]
    return [src, *protected_paths(found)]  # a file's belongings (a sidecar), not a directory's


def _weights_bytes(src: Path) -> tuple[int, int]:
    """At least the free space the run takes beside its output: the float copy (the size of
    the checkpoint's weights; 1-D tensors in F32 add little) and the output (at most as much);
    and the bytes of the weights' data (the files less their headers).
    Each weights file is sized on a descriptor opened as checked_model opens it, never by a
    stat through its path: a dangling, looping or outward link counts nothing here (not an
    internal error, nor the size of a file outside the directory), and checked_model refuses
    it once the outputs are checked."""
    weights = data = 0
    with contextlib.closing(InputDir(src)) as within:
        for name in within.names():
            if name.endswith(".safetensors"):
                try:
                    fd = within.open_fd(name)
                except (Refused, FileNotFoundError):
                    continue
                try:
                    size = os.fstat(fd).st_size
                    header = int.from_bytes(os.pread(fd, 8, 0), "little") if size >= 8 else size
                finally:
                    os.close(fd)
                weights += size
                data += max(0, size - 8 - header)
    return 2 * weights, data


def _within_file_size_limit(least: int, target: Path) -> None:
    """The float copy (at least `least` bytes: half the weights' data, an F32 checkpoint's
    F16 copy) refused before any work when it is over this process's file-size limit, as a
    float type's output is refused; it failed once that many bytes were written."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and least > limit:
        raise OutputError(
            os.path.abspath(target.parent), f"qtool's temporary float GGUF of the input (at "
            f"least {least:,} bytes) is larger than this process's file-size limit "
            f"({limit:,} bytes, ulimit -f), so it cannot be written; raise the limit",
        )  # fmt: skip


def _named_for_user(err: QtoolError, scratch_file: Path, src: Path) -> QtoolError:
    """An error about the scratch copy as the user's files name it: reading it is the input's
    problem, writing it the output directory's."""
    if err.path != str(scratch_file):
        return err
    if isinstance(err, OutputError):
        err.path = os.path.abspath(scratch_file.parent.parent)
        err.message = f"writing qtool's temporary float GGUF of the input here: {err.message}"
    else:
        err.path = str(src)
    return err


def write_float(
    src: Path, out: Path | None, options: QuantizeOptions, run: RunOptions
) -> QuantizeSummary:
    """The float GGUF of the model directory `src` in the spec's type, written as the output
    itself (convert_hf_to_gguf.py --outtype f16|bf16|f32, byte for byte): no scratch copy, no
    tensor quantized. A dry run builds the header alone in a memory file: its sizes are the
    file's, and there are no error figures to measure (a cast has none); with --estimate the
    values are read and F16's range checked as the run checks it."""
    kind = float_type(options)
    fmt = entry(options.format.value)
    assert kind is not None
    if not os.path.lexists(src):  # as every quantized type reports it, not 'not a directory'
        raise InputError(src, "no such file or directory; check the path")
    if fmt.converts is None or fmt.convert is None or not fmt.converts(src):
        raise UsageError(src, f"is not a model directory (config.json and .safetensors weights): "
                         f"{kind} is the float GGUF converted from one, as llama.cpp's "
                         f"convert_hf_to_gguf.py --outtype {kind.lower()} writes it; a GGUF "
                         "file is re-typed by `qtool dequantize`")  # fmt: skip
    _no_choices(options, kind, src)
    started = time.perf_counter()
    target = quantized_output(src, out, kind, fmt.suffix)
    refuse_nesting(target, [src])  # `-o HF_DIR`: a new file in the model's directory
    for p in run.also:
        refuse_nesting(p, [src])
    estimate = run.mode is Mode.ESTIMATE  # reads the values: F16's range is checked
    dry = run.mode is not Mode.WRITE
    with checked_model(src) as copy:  # the files checked once, for the plan and the write
        planned, size = _header_in_memory(copy, fmt.convert, kind, estimate)
        preflight([target, *run.also], read_files(src), force=run.force, needed_bytes=size)
        converted = planned
        if not dry:
            with OutputSet() as outputs:
                converted = fmt.convert(copy, target, outputs, kind)
                outputs.commit()
    header = getattr(converted, "header", None)
    assert isinstance(header, GGUFHeader)  # hf_export.Converted's
    sources: dict[str, tuple[str, int]] = getattr(converted, "sources", {})
    rows = _float_rows(header, sources, kind)
    return QuantizeSummary(
        inputs=[str(src)], outputs=[str(target)], rows=rows, spec=options.spec, device="cpu",
        dry_run=dry, format=options.format.value, seconds=time.perf_counter() - started,
        remarks=[_what_was_written(rows, kind)],
    )  # fmt: skip


def _what_was_written(rows: list[QuantizeRow], kind: str) -> str:
    """The summary's note: a conversion, so every tensor 'kept' is by design, in which types."""
    wide = sum(r.out_dtype == kind for r in rows)
    rest = (
        f", {len(rows) - wide} F32 (1-D tensors and norms, as it keeps them)"
        if kind != "F32"
        else ""
    )
    return (f"a float GGUF, nothing quantized: {wide} tensors {kind} as convert_hf_to_gguf.py "
            f"--outtype {kind.lower()} writes them{rest}")  # fmt: skip


def _no_choices(options: QuantizeOptions, kind: str, src: Path) -> None:
    """What chooses or weighs codes means nothing to a conversion: refused, not ignored."""
    given = {"rules": bool(options.rules), "a target": options.budgeted,
             "an imatrix": options.imatrix is not None,
             "a calibrated method": options.calibration is not None}  # fmt: skip
    for what, set_ in given.items():
        if set_:
            raise UsageError(src, f"{kind} converts the model and quantizes nothing: drop "
                             f"{what}")  # fmt: skip


def _header_in_memory(
    src: Path, convert: Callable[..., object], kind: str, check_values: bool = False
) -> tuple[object, int]:
    """Every check the conversion makes and its header alone, in a memory file (a temporary
    file where memfd does not exist; its data a hole, never read): what it writes and the
    file's size."""
    memfd = hasattr(os, "memfd_create")
    with nullcontext() if memfd else tempfile.NamedTemporaryFile() as tmp:
        fd = os.memfd_create("qtool-plan", os.MFD_CLOEXEC) if tmp is None else tmp.fileno()
        try:
            where = Path(f"/proc/self/fd/{fd}" if tmp is None else tmp.name)
            converted = convert(src, where, None, kind, True, check_values)
            return converted, os.fstat(fd).st_size
        except OutputError as err:
            err.path, err.message = None, _in_memory(err.message, "the output")
            raise
        finally:
            if tmp is None:
                os.close(fd)


def _float_rows(
    header: GGUFHeader, sources: dict[str, tuple[str, int]], kind: str
) -> list[QuantizeRow]:
    """One row per tensor of the float GGUF: the checkpoint's dtype and bytes in, the type and
    bytes written, and why (the converter keeps 1-D tensors and norms F32)."""
    rows = []
    for t in header.tensors:
        dtype, nbytes = sources.get(t.name, ("F32", 0))  # a generated tensor: nothing read
        written = t.type.name
        if t.name not in sources:
            why = f"{written}: generated (llama3 rope factors, as the converter adds them)"
        elif written != kind:
            why = f"{written}: 1-D or a norm (the converter keeps them F32)"
        else:
            why = f"{written} (convert_hf_to_gguf.py --outtype {kind.lower()})"
        rows.append(QuantizeRow(t.name, t.torch_shape, dtype, written, False, why, nbytes,
                                t.nbytes))  # fmt: skip
    return rows


@contextlib.contextmanager
def checked_model(src: Path) -> Iterator[Path]:
    """A private directory (0700, removed on exit) the conversion reads instead of `src`: the
    files of READ_FILES and additional_chat_templates/*.jinja that `src` holds, each read once
    through `src`'s descriptor (a regular file inside it: no link out, no FIFO, at most
    MAX_TOKENIZER_BYTES, MAX_TOKENIZER_TOTAL together) and copied; each .safetensors file a
    link to a descriptor opened the same way (the weights are not copied; hf_export reads them
    with pread, never mapped). gguf-py, tokenizers and the weights' reader then open by path
    only what qtool checked, and a file swapped or linked out after the check is never read.
    Errors naming the copy name the file in `src`."""
    with contextlib.closing(InputDir(src)) as within, private_dir("export") as private:
        fds: dict[str, int] = {}
        seen: dict[str, FileStamp] = {}  # each weights file's stamp when opened
        made: list[str] = []
        scratch = private / (src.name or Path(os.path.abspath(src)).name or "model")
        try:
            with _setting_up(private):
                _fill(within, scratch, fds)
            seen = {name: fstamp(fd) for name, fd in fds.items()}
            made = os.listdir(scratch)
            yield scratch
        except (QtoolError, OSError) as err:
            _still_there(scratch, made)
            if not isinstance(err, QtoolError):
                raise
            raise _named_in(_changed(err, scratch, fds, seen), scratch, src) from None
        finally:
            for fd in fds.values():
                os.close(fd)


@contextlib.contextmanager
def _setting_up(private: Path) -> Iterator[None]:
    """OSError while the private copy is made (no space or inodes there, no descriptor left)
    as one line naming where, and what to do."""
    try:
        yield
    except OSError as err:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if err.errno == errno.EFBIG and limit != resource.RLIM_INFINITY:
            what = f"a tokenizer file is over this process's file-size limit ({limit:,} bytes, "
            todo = "ulimit -f); raise the limit"
        else:
            what = "free space there or set TMPDIR to another directory, "
            todo = "or raise the open-file limit (ulimit -n)"
        raise OutputError(
            None, f"cannot make the private copy of the model in {private.parent}: "
            f"{err.strerror or err}; {what}{todo}",
        ) from None  # fmt: skip


def _fill(within: InputDir, scratch: Path, fds: dict[str, int]) -> None:
    """The private copy of checked_model in `scratch`, the weights' descriptors into `fds`
    (by name)."""
    scratch.mkdir(mode=0o700)  # named as the model: gguf-py's Metadata names it so
    total = _copy(within, READ_FILES, scratch, 0)
    found = within.lstat(TEMPLATES)  # a regular file of that name: gguf-py skips it
    if found is not None and not stat.S_ISREG(found.st_mode):
        try:
            sub = within.subdir(TEMPLATES)
        except Refused as why:
            where = within.file(TEMPLATES)
            raise InputError(where, f"{why}; qtool reads only directories inside the "
                             "model directory") from None  # fmt: skip
        with contextlib.closing(sub):
            (scratch / TEMPLATES).mkdir(mode=0o700)
            jinja = [n for n in sub.names() if n.endswith(".jinja")]
            _copy(sub, jinja, scratch / TEMPLATES, total)
    for name in within.names():
        if name.endswith(".safetensors"):
            with within.open(name) as f:  # InputError: a link out, a FIFO, ...
                fds[name] = os.dup(f.fileno())
            os.symlink(_fd_path(fds[name]), scratch / name)


def _copy(within: InputDir, names: tuple[str, ...] | list[str], to: Path, total: int) -> int:
    """Each of `names` that `within` holds, read through its descriptor into `to`; the bytes
    copied so far (`total` and these)."""
    present = set(within.names())
    for name in names:
        if name not in present:
            continue
        where, what = within.file(name), "a tokenizer or config file"
        with within.open(name) as f:  # a sparse file over the limit: refused, not read
            if os.fstat(f.fileno()).st_size > MAX_TOKENIZER_BYTES:
                raise InputError(where, f"{what} is over {MAX_TOKENIZER_BYTES:,} bytes; is it "
                                 "intact?")  # fmt: skip
            data = read_limited(f, MAX_TOKENIZER_BYTES, what, where)
        total += len(data)
        if total > MAX_TOKENIZER_TOTAL:
            raise InputError(within.file(name), f"the config and tokenizer files are over "
                             f"{MAX_TOKENIZER_TOTAL:,} bytes together; refusing to read "
                             "them")  # fmt: skip
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(to / name, flags, 0o600), "wb") as f:  # OSError: _setting_up's
            f.write(data)
    return total


def _fd_path(fd: int) -> str:
    """A path that opens the file of this process's descriptor `fd` (Linux: /proc/self/fd)."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


def _still_there(scratch: Path, made: list[str]) -> None:
    """OutputError when a file of the private copy is gone (a TMPDIR cleaner removed it while
    the run read it): what the run then fails on ('no tokenizer.json', a missing weights file)
    is not the model directory's fault."""
    gone = [name for name in made if not os.path.lexists(scratch / name)]
    if gone:
        raise OutputError(
            None, f"qtool's private copy of the model in {scratch.parent.parent} vanished while "
            f"the run read it ({gone[0]} was removed, by a cleaner of that directory?); run "
            "again, or set TMPDIR to a directory nothing cleans",
        )  # fmt: skip


def _changed(
    err: QtoolError, scratch: Path, fds: dict[str, int], seen: dict[str, FileStamp]
) -> QtoolError:
    """An input error about a weights file that changed since checked_model opened it (its
    filestamp: size, times, inode): a file appended to or rewritten under the run reads as
    malformed ("trailing bytes not covered by the header") where the cause is the change, and
    running again is what to do."""
    where = Path(err.path) if err.path is not None else None
    if not isinstance(err, InputError) or where is None or where.parent != scratch:
        return err
    if isinstance(err, ChangedError):  # the reader saw the change: its words say more
        return err
    name = where.name
    if name not in seen or (now_stamp := fstamp(fds[name])) == seen[name]:
        return err
    before, now = seen[name][2], now_stamp[2]  # the sizes
    how = f"its size went from {before:,} to {now:,} bytes" if now != before else "rewritten"
    return InputError(err.path, f"changed while qtool was reading it ({how}); run again once "
                      "nothing is writing it", err.tensor)  # fmt: skip


def _named_in(err: QtoolError, scratch: Path, src: Path) -> QtoolError:
    """An error about the private copy as the user's directory names it."""
    where = str(scratch)
    if err.path is not None and str(err.path).startswith(where):
        err.path = str(src) + str(err.path)[len(where) :]
    err.message = err.message.replace(where, str(src))
    return err


def _in_memory(message: str, what: str) -> str:
    """An error writing the plan's memory file, for the user: a file-size limit holds for
    memory files too, so a ulimit -f below the output's size stops the plan (and would stop the
    real write): that is what to change, not the output directory."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if "too large" in message and limit != resource.RLIM_INFINITY:
        return (f"{what} is larger than this process's file-size limit ({limit:,} bytes, "
                "ulimit -f), so it cannot be written; raise the limit")  # fmt: skip
    return f"planning in memory: {message}"
