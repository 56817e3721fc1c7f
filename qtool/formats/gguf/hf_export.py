"""A Hugging Face model directory of the Llama family written as a float GGUF, as llama.cpp's
convert_hf_to_gguf.py writes it (llama-cpp-python 0.3.36's vendored converter: conversion/
base.py's TextModel, llama.py's LlamaModel, qwen.py's Qwen2Model), for `quantize HF_DIR
--format gguf` to quantize as any float GGUF.

    converted = export_float(directory, out, outputs)        # out: a temp file of `outputs`

What it writes, in the converter's order: general.* (architecture, type, name and size label
by gguf-py's Metadata), the hyperparameters (TextModel.set_gguf_parameters: context, embedding
and feed-forward lengths, head counts, rope base and scaling, rms eps, key/value length, file
type; llama also vocab size and rope dimension count), quantization version, the vocabulary
(hf_vocab.py), then the tensors in the checkpoint's order under gguf-py's TensorNameMap names:
1-D ones, norms and non-.weight ones F32 (kept_f32), the others in `float_type` (default: the
converter's "auto", the type of the first 2-D tensor when BF16 or F16, else F16; F32 instead
when an F32 value would overflow F16), cast as the converter casts (cast: numpy's F16/F32,
ggml's BF16 rounding). `quantize --dtype F16` writes this file as the output itself. For
llama the rows of q_proj/k_proj are permuted as LlamaModel.permute does (llama.cpp's rotary
embedding pairs rows differently); a tied model has no output.weight (llama.cpp reuses
token_embd.weight); Qwen2's q/k/v biases are kept; rope_type llama3 adds rope_freqs.weight.
Anything else is refused, naming what.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qtool.errors import ChangedError, InputError, NumericError, OutputError, UsageError
from qtool.formats.gguf.hf_config import check_config, check_shapes, head_dim, rope_parameters
from qtool.formats.gguf.hf_vocab import CONVERTER, INSTALL_TOKENIZERS, add_vocab
from qtool.formats.gguf.names import MAX_BLOCKS, gguf_names
from qtool.formats.gguf.reader import INSTALL_GGUF, out_of_memory
from qtool.gguf_types import GGML_TYPES, ValueType
from qtool.io.atomic import OutputSet, describe_os_error
from qtool.io.checkpoint import open_safetensors
from qtool.io.gguf_layout import GGUFHeader, GGUFValue
from qtool.io.gguf_write import GGUFStreamWriter, build_header
from qtool.io.jsonfile import read_json_object
from qtool.io.readbuffer import ReadBuffer
from qtool.io.stformat import Header, HeaderError, not_safetensors_message, read_header

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                 "Qwen2ForCausalLM": "qwen2"}  # fmt: skip
"""config.json `architectures` qtool converts -> the GGUF architecture the converter gives."""
FLOAT_FILE_TYPES = {"F32": 0, "F16": 1, "BF16": 32}  # llama_ftype's ALL_F32, MOSTLY_F16/BF16
SKIPPED = (".rotary_emb.inv_freq",)  # computed by every runtime; the converter drops them
_NUMPY = {ValueType.INT32: np.int32, ValueType.UINT32: np.uint32, ValueType.FLOAT32: np.float32,
          ValueType.BOOL: np.bool_}  # fmt: skip


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the output: its Hugging Face name and file, GGUF name, type and shape
    (torch order)."""

    hf: str
    file: Path
    gguf: str
    type: str
    shape: tuple[int, ...]
    source: str = ""  # the checkpoint's dtype (F32, F16, BF16)


def is_convertible(path: Path) -> bool:
    """Whether `path` is a model directory (config.json and safetensors weights) that
    export_float is for: `quantize --format gguf` converts it first."""
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def read_config(directory: Path) -> tuple[dict[str, Any], str]:
    """config.json and the GGUF architecture of its `architectures`; InputError otherwise."""
    path = directory / "config.json"
    config: dict[str, Any] = read_json_object(path, what="model config")
    archs = config.get("architectures")
    name = archs[0] if isinstance(archs, list) and archs else None
    if name not in ARCHITECTURES:
        known = ", ".join(ARCHITECTURES)
        raise InputError(path, f"architectures is {archs!r}: qtool converts {known} to GGUF; "
                         f"for others {CONVERTER}")  # fmt: skip
    check_config(config, path)
    if config["num_hidden_layers"] > MAX_BLOCKS:  # the name map's work grows with it
        raise InputError(path, f"num_hidden_layers is {config['num_hidden_layers']:,}, over "
                         f"llama.cpp's limit of {MAX_BLOCKS} blocks")  # fmt: skip
    return config, ARCHITECTURES[str(name)]


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's .safetensors files, sorted (the converter's order of parts)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InputError(directory, "holds no .safetensors weights")
    return files


def plan_tensors(directory: Path, config: dict[str, Any], arch: str, float_type: str | None
                 ) -> tuple[list[HFTensor], str]:  # fmt: skip
    """Every tensor the GGUF holds, in the converter's order, and the 2-D float type."""
    found: list[tuple[str, Path, tuple[int, ...], torch.dtype]] = []
    first: dict[str, Path] = {}
    for file in weight_files(directory):
        for t in sorted(_header(file).tensors, key=lambda t: t.name):
            if t.name.endswith(SKIPPED):
                continue
            if t.name in first:
                raise InputError(file, f"holds it, and so does {first[t.name].name}: which is the "
                                 "model's? remove the stray file", t.name)  # fmt: skip
            first[t.name] = file
            found.append((t.name, file, t.shape, _dtype(t.dtype, file, t.name)))
    _check_vocab(config, found, directory)
    check_shapes(config, [(name, shape) for name, _, shape, _ in found], directory / "config.json")
    chosen = float_type or _auto(found)
    mapped = gguf_names(arch, int(config["num_hidden_layers"]), [n for n, *_ in found])
    out: list[HFTensor] = []
    for name, file, shape, dtype in found:
        target = mapped.get(name)
        if target is None:
            raise InputError(
                file, f"gguf's name map for {arch} has no GGUF name for it; {CONVERTER}", name
            )
        kind = "F32" if kept_f32(target, shape) else chosen
        out.append(HFTensor(name, file, target, kind, shape, _NAMES[dtype]))
    return out, chosen


def kept_f32(gguf_name: str, shape: tuple[int, ...]) -> bool:
    """The converter's tensors that stay F32 whatever --outtype says (ModelBase.prepare_tensors:
    1-D tensors, norms, and anything not named .weight, such as biases)."""
    norm = gguf_name.endswith("_norm.weight")
    return len(shape) <= 1 or norm or not gguf_name.endswith(".weight")


def _header(file: Path) -> Header:
    """The shard's header, checked as every safetensors input is (qtool's parser: offsets
    within the file, so a truncated shard is refused here, not half-way through the copy)."""
    try:
        return read_header(file)
    except HeaderError as err:
        raise InputError(file, not_safetensors_message(file, err)) from None
    except OSError as err:
        raise InputError(file, f"cannot read: {err.strerror or err}") from None


EMBEDDING = "model.embed_tokens.weight"


_Found = list[tuple[str, Path, tuple[int, ...], torch.dtype]]


def _check_vocab(config: dict[str, Any], found: _Found, directory: Path) -> None:
    """config.json's vocab_size is the embedding's row count (llama.cpp refuses a GGUF whose
    token list and token_embd differ), which also bounds the token list by the checkpoint's
    size, whatever the config says."""
    rows = next((shape[0] for name, _, shape, _ in found if name == EMBEDDING and shape), None)
    if rows is None:
        raise InputError(directory, f"has no {EMBEDDING}: not a Llama-family checkpoint")
    if rows != config["vocab_size"]:
        raise InputError(directory / "config.json", f"vocab_size is {config['vocab_size']:,}, "
                         f"but {EMBEDDING} has {rows:,} rows; fix the config")  # fmt: skip


_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _dtype(text: str, file: Path, name: str) -> torch.dtype:
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    if text not in dtypes:
        raise InputError(file, f"is {text}: qtool converts F32, F16 and BF16 checkpoints; "
                         "dequantize it first", name)  # fmt: skip
    return dtypes[text]


def _auto(found: list[tuple[str, Path, tuple[int, ...], torch.dtype]]) -> str:
    """The converter's --outtype auto: the first 2-D tensor's type if BF16 or F16, else F16."""
    for _, _, shape, dtype in found:
        if len(shape) >= 2:
            return "BF16" if dtype is torch.bfloat16 else "F16"
    return "F16"


def metadata(directory: Path, config: dict[str, Any], arch: str, float_type: str,
             tensors: list[HFTensor]) -> dict[str, GGUFValue]:  # fmt: skip
    """Every metadata key in the converter's order, built with gguf-py's GGUFWriter (its key
    names and value types)."""
    import gguf

    writer = gguf.GGUFWriter(None, arch)
    total = sum(math.prod(t.shape) for t in tensors)
    meta = gguf.Metadata.load(None, directory, None, total)
    if meta.name is None:
        meta.name = directory.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, 0, 0, 0)
    writer.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(writer)
    _hparams(writer, config, directory)
    writer.add_file_type(FLOAT_FILE_TYPES[float_type])
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim(config))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab(writer, directory, int(config["vocab_size"]), arch)
    return {key: _value(key, v) for key, v in writer.kv_data[0].items()}


def _hparams(writer: Any, config: dict[str, Any], directory: Path) -> None:
    """TextModel.set_gguf_parameters for the keys a Llama/Qwen2/Mistral config has."""
    import gguf

    writer.add_block_count(config["num_hidden_layers"])
    if (n_ctx := config.get("max_position_embeddings")) is not None:
        writer.add_context_length(n_ctx)
    writer.add_embedding_length(config["hidden_size"])
    if (n_ff := config.get("intermediate_size")) is not None:
        writer.add_feed_forward_length(n_ff)
    writer.add_head_count(config["num_attention_heads"])
    if (n_kv := config.get("num_key_value_heads")) is not None:
        writer.add_head_count_kv(n_kv)
    rope = rope_parameters(config)
    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind not in (None, "default", "llama3"):
        raise InputError(directory / "config.json", f"rope type {kind!r}: qtool writes default, "
                         f"linear, yarn and llama3 rope scaling; {CONVERTER}")  # fmt: skip
    if (theta := rope.get("rope_theta")) is not None:
        writer.add_rope_freq_base(theta)
    if (eps := config.get("rms_norm_eps")) is not None:
        writer.add_layer_norm_rms_eps(eps)
    if (dim := config.get("head_dim")) is not None:
        writer.add_key_length(dim)
        writer.add_value_length(dim)


def rope_freqs(config: dict[str, Any]) -> torch.Tensor | None:
    """LlamaModel.generate_extra_tensors: llama3 rope scaling's per-frequency factors."""
    rope = rope_parameters(config)
    if str(rope.get("rope_type", "")).lower() != "llama3":
        return None
    base = rope.get("rope_theta", 10000.0)
    dim = head_dim(config)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _value(key: str, v: Any) -> GGUFValue:
    """gguf-py's GGUFValue as qtool's (an array's item type as GGUFWriter infers it)."""
    kind = ValueType(int(v.type))
    if kind is not ValueType.ARRAY:
        return GGUFValue(kind, v.value)
    items = list(v.value)
    if not items:
        raise ValueError(f"metadata {key!r}: an empty array")
    if isinstance(items[0], str):
        return GGUFValue(kind, tuple(items), ValueType.STRING)
    item = ValueType(int(v.sub_type)) if v.sub_type is not None else _item_type(items[0])
    array: np.ndarray = np.asarray(items, dtype=_NUMPY[item])
    array.flags.writeable = False
    return GGUFValue(kind, array, item)


def _item_type(first: object) -> ValueType:
    if isinstance(first, bool):
        return ValueType.BOOL
    return ValueType.INT32 if isinstance(first, int) else ValueType.FLOAT32


def permute(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """LlamaModel.permute: the rows of q/k (weight or bias) from the Hugging Face rotary
    layout (halves) to llama.cpp's (pairs); names.to_hf undoes it."""
    rows = x.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows are not {n_head} heads of pairs")
    return x.reshape(n_head, 2, rows // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def tensor_data(t: HFTensor, values: torch.Tensor, arch: str, config: dict[str, Any]) -> np.ndarray:
    """The tensor's bytes as the converter writes them: permuted for llama's q/k, then cast."""
    if arch == "llama":
        heads = config["num_attention_heads"]
        if t.hf.endswith(("q_proj.weight", "q_proj.bias")):
            values = permute(values, heads)
        elif t.hf.endswith(("k_proj.weight", "k_proj.bias")):
            values = permute(values, config.get("num_key_value_heads") or heads)
    if t.type != "F16" or values.dtype == torch.float16:
        return cast(values, t.type).view(np.uint8).reshape(-1)
    overflow = F16Overflow()
    out = cast(values, t.type, overflow)
    if overflow.count:  # A finite value F16 rounds to Inf: llama.cpp would compute with Inf
        raise NumericError(
            t.file, f"{overflow.count:,} values beyond F16's range (largest |x| "
            f"{overflow.largest:.6g}, F16's largest {F16_MAX:g}) would be written as Inf; write "
            "BF16 or F32 instead", t.hf,
        )  # fmt: skip
    return out.view(np.uint8).reshape(-1)


CHUNK = 1 << 22
"""Elements cast at a time: the float32 copy a BF16 tensor passes through stays 16 MiB."""


def cast(values: torch.Tensor, kind: str, overflow: F16Overflow | None = None) -> np.ndarray:
    """`values` in GGUF type `kind` as the converter casts them: a BF16 tensor through float32
    (it converts every dtype but F16 and F32 first), then numpy's astype for F32 and F16 (round
    to nearest even; beyond F16's range: Inf) and gguf-py's BF16 rounding (bf16_bits). A
    chunk of elements at a time; `overflow` (F16) counts the finite values that became Inf."""
    out = np.empty(values.numel(), dtype=np.uint16 if kind == "BF16" else _NP_TYPES[kind])
    for start, a in _chunks(values):
        with np.errstate(over="ignore", invalid="ignore"):  # Inf as the converter writes it
            part = bf16_bits(a) if kind == "BF16" else a.astype(out.dtype)
        if overflow is not None:
            overflow.add(a, part)
        out[start : start + a.size] = part
    return out


def _chunks(values: torch.Tensor) -> Iterator[tuple[int, np.ndarray]]:
    """`values` flat, CHUNK elements at a time as numpy arrays (F16 and F32 as they are, any
    other dtype through float32, as the converter casts it), each with its start."""
    flat = values.reshape(-1)
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start : start + CHUNK]
        if part.dtype not in (torch.float16, torch.float32):
            part = part.to(torch.float32)
        yield start, part.numpy()


@dataclass
class F16Overflow:
    """The finite values whose F16 cast is Inf (|x| >= 65520: up to that F16 rounds to its
    largest, 65504), counted a chunk at a time, and the largest of their magnitudes. The one
    rule of F16's range: the refusal of an F16 output and the auto type's F32 copy both use it."""

    count: int = 0
    largest: float = 0.0

    def add(self, a: np.ndarray, half: np.ndarray) -> None:
        """Count the chunk `a` whose F16 cast is `half`."""
        hit = np.isinf(half)  # a chunk's bools: CHUNK bytes
        if not hit.any():
            return
        hit &= np.isfinite(a)
        n = int(np.count_nonzero(hit))
        if n:
            self.count += n
            self.largest = max(self.largest, float(np.abs(a[hit]).max()))


_NP_TYPES = {"F32": np.float32, "F16": np.float16}


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16 (gguf-py's BF16.quantize_blocks): round to nearest even on
    the float32 bits; a NaN keeps its sign and upper payload, made quiet (bit 22 set), so it
    stays a NaN whatever its payload."""
    n = a.astype(np.float32, copy=False).view(np.uint32)
    nan = (n & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    n = np.where(nan, (n & np.uint32(0xFFFF0000)) | np.uint32(0x00400000), n)
    wide = n.astype(np.uint64) + (np.uint64(0x7FFF) + ((n >> np.uint32(16)) & np.uint32(1)))
    return (wide >> np.uint64(16)).astype(np.uint16)


@dataclass(frozen=True)
class Converted:
    """What export_float wrote: the float GGUF's header, and for each GGUF tensor taken from
    the checkpoint its dtype and size there (a report names the checkpoint as the input)."""

    header: GGUFHeader
    sources: dict[str, tuple[str, int]]


_ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def export_float(
    directory: Path,
    out: Path,
    outputs: OutputSet | None,
    float_type: str | None = None,
    header_only: bool = False,
    check_values: bool = False,
) -> Converted:
    """Write the float GGUF of the model directory `directory` to `out` (a temp file of
    `outputs`); returns its header and the tensors' sources. `float_type`: F32, F16 or BF16
    for the 2-D tensors (None: the converter's auto). `header_only` (a dry run's plan): every
    check the export makes, then only the header written to `out` (an existing file, such as
    a memory file; `outputs` unused), its length set to the whole file's with no data: the
    values are never read (an F32 checkpoint is planned as the F16 copy auto makes), unless
    `check_values` (--estimate of an F16 output): each tensor F16 may not hold is cast and
    checked as the real run does, nothing kept."""
    if float_type is not None and float_type not in FLOAT_FILE_TYPES:
        raise UsageError(None, f"{float_type} is not a float GGUF type (F32, F16, BF16)")
    require_packages()
    config, arch = read_config(directory)
    tensors, chosen = plan_tensors(directory, config, arch, float_type)
    if not header_only and float_type is None and chosen == "F16" and _overflows_f16(tensors):
        tensors, chosen = [replace(t, type="F32") for t in tensors], "F32"
    extra = rope_freqs(config)
    meta = metadata(directory, config, arch, chosen, tensors)
    specs = [(t.gguf, GGML_TYPES[t.type], tuple(reversed(t.shape))) for t in tensors]
    if extra is not None:
        specs.append(("rope_freqs.weight", GGML_TYPES["F32"], tuple(extra.shape)))
    header, layout = build_header(meta, specs)
    sources = {t.gguf: (t.source, math.prod(t.shape) * _ITEM_BYTES[t.source]) for t in tensors}
    if header_only:
        data = sum(i.nbytes + -i.nbytes % layout.alignment for i in layout.tensors)
        try:
            with open(out, "r+b") as f:
                f.write(header)
                f.truncate(len(header) + data)
        except OSError as err:  # a file-size limit holds for memory files too
            raise OutputError(out, f"cannot write: {describe_os_error(err)}") from None
        if check_values:
            narrowed = [t for t in tensors if t.type == "F16" and t.source != "F16"]
            for t, values in _values(narrowed):
                with _memory(t):
                    tensor_data(t, values, arch, config)
        return Converted(layout, sources)
    assert outputs is not None
    writer = GGUFStreamWriter(outputs.create(out), header, layout)
    try:
        for t, values in _values(tensors):
            with _memory(t):  # the cast's copy (and q/k's permuted one)
                written = tensor_data(t, values, arch, config)
            writer.write(written)
        if extra is not None:
            writer.write(extra.numpy())
        writer.finish()
    except OSError as err:  # a full disk, a file size limit
        raise OutputError(out, f"cannot write: {describe_os_error(err)}") from None
    return Converted(layout, sources)


F16_MAX = 65504.0


def _overflows_f16(tensors: list[HFTensor]) -> bool:
    """Whether a finite value of an F32 tensor the auto type writes as F16 becomes Inf in
    F16 (F16Overflow's rule, as an F16 output's refusal): it would be Inf in the copy (the
    converter's auto makes that F16 copy, Inf included), and the quantizers would refuse the
    checkpoint for a value it does not hold. One pass over the F32 tensors, a chunk at a time;
    F16 and BF16 checkpoints are not read."""
    wide = [t for t in tensors if t.type == "F16" and t.source == "F32"]
    for _, values in _values(wide):
        overflow = F16Overflow()
        for _, a in _chunks(values):
            with np.errstate(over="ignore"):
                overflow.add(a, a.astype(np.float16))
            if overflow.count:
                return True
    return False


def require_packages() -> None:
    """gguf (its key names, name map and SpecialVocab) and tokenizers (the pre-tokenizer's
    hash) import, else UsageError naming the package to install, before any work."""
    for name, install in (("gguf", INSTALL_GGUF), ("tokenizers", INSTALL_TOKENIZERS)):
        try:
            importlib.import_module(name)
        except ImportError:
            raise UsageError(None, f"converting a Hugging Face directory to GGUF needs the {name} "
                             f"package; install it with {install}") from None  # fmt: skip


def _values(tensors: list[HFTensor]) -> Iterator[tuple[HFTensor, torch.Tensor]]:
    """Each tensor's values, one at a time, each file opened once and read with pread into one
    reused buffer (io/checkpoint.py; the values are valid until the next is read), never mapped:
    a file that shrinks under the run is one line naming it and the tensor, not a SIGBUS."""
    by_file: dict[Path, list[HFTensor]] = {}
    for t in tensors:
        by_file.setdefault(t.file, []).append(t)
    buffer = ReadBuffer()
    for file, items in by_file.items():
        ckpt = open_safetensors(file)  # InputError: no longer the file plan_tensors checked
        try:
            entries = ckpt.by_name()
            for t in items:
                entry = entries.get(t.hf)
                if entry is None or (entry.shape, entry.dtype) != (t.shape, t.source):
                    raise ChangedError(file, "changed while reading (its header differs from the "
                                     "one checked); run again once nothing is writing it",
                                     t.hf)  # fmt: skip
                try:
                    with _memory(t):
                        values = ckpt.tensor(entry, buffer)
                except OSError as err:  # EIO: the input's, not the output's (export's except)
                    raise InputError(file, f"cannot read it: {err.strerror or err}",
                                     t.hf) from None  # fmt: skip
                yield t, values
            ckpt.check_unchanged()  # rewritten in place while read: the values may be torn
        finally:
            ckpt.close()


def _memory(t: HFTensor) -> contextlib.AbstractContextManager[None]:
    """A tensor too large for the memory this process may use (ulimit -v, a container's
    limit): its buffer, or the cast's copy, not allocated. An InputError naming the file and
    the tensor and what to do, as the GGUF reader says it; not "cannot read it" (the file is
    fine) nor an internal error."""
    nbytes = math.prod(t.shape) * _ITEM_BYTES[t.source]
    return out_of_memory(t.file, f"its {t.source} data of {nbytes:,} bytes", t.hf)
