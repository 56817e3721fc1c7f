"""Writing compressed-tensors: the output format the quantize loop feeds (formats/base.py).

Selection, group fallback and the fused-set check come from selection.py (over the whole model,
before any data is read), config.json from config.py, the tensors of each quantized Linear from
codec.py. A shard is written with its header first and each tensor
at its offset, so one input tensor can become several output tensors of different dtypes
(which safetensors lays out apart) while only one tensor is held at a time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from qtool import __version__
from qtool.errors import InputError, OutputError, RecipeError, UsageError
from qtool.formats import stale_config
from qtool.formats.base import Choice, FormatContext, OutputFormat, Planned, Ruled
from qtool.formats.compressed_tensors import config as ct_config
from qtool.formats.compressed_tensors import groups, loaders
from qtool.formats.compressed_tensors import selection as ct
from qtool.formats.compressed_tensors.codec import encode_result, fp16_underflow_warning
from qtool.formats.compressed_tensors.modules import Linears, model_linears
from qtool.io.atomic import OutputSet, describe_os_error
from qtool.io.checkpoint import ST_TO_TORCH, tensor_bytes
from qtool.io.jsonfile import read_json_object
from qtool.io.safeopen import InputDir
from qtool.io.stformat import TensorEntry, build_header
from qtool.numerics.kernels import QuantizedTensor
from qtool.numerics.range_methods import search_candidates
from qtool.spec import Codec, PerGroup, as_grid


def read_model_config(path: Path | None, within: InputDir | None = None) -> dict[str, object]:
    """config.json as a dict (InputError naming the file when it is missing or malformed), read
    by the one bounded, regular-file-only reader (through `within` when it is the model
    directory's)."""
    if path is None:
        raise UsageError(
            None,
            "a single file needs the model's config.json for a compressed-tensors export; "
            "pass --config PATH, or give the model directory",
            hint="config",
        )
    doc = read_json_object(path, within=within, what="model config")
    if not stale_config.is_gguf_marker(doc):  # that one the weights decide (select)
        ct_config.check_not_quantized(doc, path)
    return doc


def _check_fused(selections: Sequence[ct.Selection]) -> None:
    """InputError when sibling Linears vLLM fuses (q/k/v, gate/up) are treated differently."""
    problems = ct.fused_inconsistencies(selections)
    if problems:
        raise InputError(
            None,
            "vLLM fuses these Linears, so they must be quantized alike: " + "; ".join(problems),
            hint="exclude",
        )


def _refuse_nothing_quantized(selections: Sequence[ct.Selection]) -> None:
    """InputError when no Linear is quantized (`--exclude '*'`, a recipe keeping everything,
    a budget that keeps every tensor): such an export would be the float model under a
    quantization_config with no config group, which loaders need not accept; qtool refuses to
    write it rather than write something it cannot vouch for."""
    if not any(s.spec is not None for s in selections):
        raise InputError(
            None,
            "no Linear layer is left to quantize (every one is excluded or kept float), so a "
            "compressed-tensors export would quantize nothing; narrow the exclusions, or use "
            "the float model as it is",
            hint="exclude",
        )


def _has_modules_json(context: FormatContext) -> bool:
    """A sentence-transformers model directory: its modules.json is a file qtool can read."""
    within = context.directory
    return within is not None and within.problem("modules.json") is None


def _module_notes(linears: Linears, config: Path | None) -> list[str]:
    """Why qtool's rules decided the module list although transformers is installed."""
    if not linears.note:
        return []
    return [f"{config}: the Linear layers were decided by qtool's rules: {linears.note}"]


class CompressedTensorsFormat(OutputFormat):
    """compressed-tensors `pack-quantized`: a model directory transformers and vLLM load."""

    name = ct.FORMAT
    model_directory = True
    scales_in_weight_dtype = True

    def __init__(self, context: FormatContext) -> None:
        self.context = context
        self.config_path = context.config
        doc = read_model_config(context.config, context.config_dir)
        self.stale_gguf = stale_config.is_gguf_marker(doc)
        self.config = {k: v for k, v in doc.items() if k != stale_config.KEY or not self.stale_gguf}
        self.fallback = context.group_fallback
        self.data_warnings: list[str] = []
        self.sentence_transformers = _has_modules_json(context)
        self._linears: Linears | None = None

    def linears(self, planned: Sequence[Planned]) -> Linears:
        """The model's Linear modules (modules.py), found once from the whole model's tensors."""
        if self._linears is None:
            entries = [p.entry for p in planned]
            self._linears = model_linears(self.config, self.config_path, entries)
        return self._linears

    def _selection(self, planned: Planned) -> ct.Selection:
        """The export's view of one planned tensor: its Linear module (None: not a Linear)."""
        entry = planned.entry
        if planned.spec is not None:
            return ct.Selection(entry, entry.name[: -len(".weight")], as_grid(planned.spec))
        return ct.Selection(entry, ct.classify(entry, self.config, self._linears).module, None)

    def _selections(self, planned: Sequence[Planned]) -> list[ct.Selection]:
        self.linears(planned)
        return [self._selection(p) for p in planned]

    def supports(self, entry: TensorEntry, spec: Codec) -> str | None:
        """Why `entry` cannot be stored with `spec` (unsigned codes, another axis, groups that
        do not divide its rows), or None."""
        spec = as_grid(spec)  # the registry lets only grids reach this format
        try:
            ct.check_spec(spec)
        except ValueError as err:
            return str(err)
        g = spec.granularity
        if isinstance(g, PerGroup) and len(entry.shape) == 2 and entry.shape[1] % g.size:
            return f"group size {g.size} does not divide K = {entry.shape[1]}"
        return None

    def select(self, planned: Sequence[Ruled]) -> list[Choice]:
        """Linear weights by name, shape and config.json; the group fallback; InputError for a
        spec it cannot store or a plan vLLM would refuse (fused siblings treated differently)."""
        if self.stale_gguf:
            entries = (p.entry for p in planned)
            stale_config.check_float_weights(((e.name, e.dtype) for e in entries), self.config_path)
        linears = self.linears(planned)
        try:
            chosen = ct.select_planned(planned, self.config, linears)
        except ct.RuleUnstorable as err:
            raise RecipeError(None, str(err)) from None
        except ValueError as err:
            raise InputError(None, str(err), hint="dtype") from None
        chosen = groups.resolve_groups(chosen, self.fallback)
        _check_fused(chosen)
        return list(chosen)

    def fused_key(self, name: str) -> str | None:
        return ct.fused_key(name.removesuffix(".weight"))

    def stored_nbytes(self, entry: TensorEntry, spec: Codec | None) -> int:
        grid = None if spec is None else as_grid(spec)
        return ct.output_nbytes(ct.Selection(entry, entry.name.removesuffix(".weight"), grid))

    def ignore(self, planned: Sequence[Planned]) -> list[str]:
        """Every Linear kept in float, by exact module name (those with no weight included)."""
        return ct.ignore_list(self._selections(planned), self.linears(planned).absent)

    def tensor_names(self, planned: Planned) -> list[str]:
        return list(ct.output_tensors(self._selection(planned)))

    def directory_files(self, planned: Sequence[Planned]) -> dict[str, bytes]:
        """config.json with the quantization_config of what was written; InputError when a
        tensor kept after planning (--keep-nonfinite) split a fused set."""
        selections = self._selections(planned)
        _check_fused(selections)
        _refuse_nothing_quantized(selections)
        candidates = {
            p.entry.name: list(c)
            for p in planned
            if p.spec is not None and (c := search_candidates(as_grid(p.spec), p.entry.shape))
        }
        qconfig = ct_config.quantization_config(
            selections,
            __version__,
            candidates,
            absent=self.linears(planned).absent,
            dequantize=self._dequantize_at_load(selections),
            imatrix=self.context.imatrix,
            texts=self.texts,
        )
        assert self.config_path is not None
        doc = ct_config.with_quantization_config(self.config, qconfig, self.config_path)
        text = json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        return {"config.json": text.encode()}

    def _dequantize_at_load(self, selections: Sequence[ct.Selection]) -> bool:
        return loaders.dequantize_at_load(selections, self.sentence_transformers)[0]

    def warnings(self, planned: Sequence[Planned]) -> list[str]:
        """What the model's module list says, the scheme's warnings, then those found in the
        data written so far (fp16 scales)."""
        selections = self._selections(planned)
        linears = self.linears(planned)
        dense, st_warning = loaders.dequantize_at_load(selections, self.sentence_transformers)
        return [
            *([stale_config.dropped_note(self.config_path)] if self.stale_gguf else []),
            *_module_notes(linears, self.config_path),
            *loaders.export_warnings(selections, dequantize=dense),
            *([st_warning] if st_warning else []),
            *self.data_warnings,
        ]

    def writer(
        self,
        planned: Sequence[Planned],
        metadata: dict[str, str] | None,
        out: Path,
        outputs: OutputSet,
    ) -> CtShardWriter:
        return CtShardWriter(self._selections(planned), out, outputs, self)


class CtShardWriter:
    """One output shard: the header first, then each tensor at its offset as it arrives."""

    def __init__(
        self,
        selections: Sequence[ct.Selection],
        out: Path,
        outputs: OutputSet,
        fmt: CompressedTensorsFormat,
    ) -> None:
        self._out, self._fmt = out, fmt
        self._modules = {s.entry.name: s.module for s in selections}
        specs = [
            (name, dtype, shape)
            for s in selections
            for name, (dtype, shape) in ct.output_tensors(s).items()
        ]
        header_bytes, header = build_header(specs, {"format": "pt"})
        self._base = len(header_bytes)
        self._entries = {e.name: e for e in header.tensors}
        self._left = set(self._entries)
        self._f: BinaryIO = outputs.create(out, last=True)
        self._put(0, header_bytes)
        self.order = [s.entry for s in selections]

    def _put(self, offset: int, data: bytes | memoryview) -> None:
        try:
            self._f.seek(offset)
            self._f.write(data)
        except OSError as err:
            raise OutputError(self._out, f"cannot write: {describe_os_error(err)}") from None

    def _tensor(self, name: str, data: memoryview) -> None:
        entry = self._entries[name]
        if data.nbytes != entry.nbytes:
            raise AssertionError(f"writer expected {name} ({entry.nbytes} B), got {data.nbytes}")
        self._put(self._base + entry.begin, data)
        self._left.discard(name)

    def keep(self, entry: TensorEntry, data: memoryview) -> None:
        self._tensor(entry.name, data)

    def quantized(self, entry: TensorEntry, spec: Codec, result: QuantizedTensor) -> None:
        module = self._modules[entry.name]
        assert module is not None
        n, k = entry.shape
        tensors = encode_result(result, as_grid(spec), (n, k), ST_TO_TORCH[entry.dtype])
        for local, t in tensors.items():
            self._tensor(f"{module}.{local}", tensor_bytes(t))
        warning = fp16_underflow_warning(entry.name, tensors["weight_scale"])
        if warning is not None:
            self._fmt.data_warnings.append(warning)

    def finish(self) -> None:
        if self._left:
            raise AssertionError(f"{len(self._left)} tensors were never written")
