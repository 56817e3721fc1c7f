"""Reading compressed-tensors checkpoints: detect, parse the config, resolve each module's scheme
(torch-free, so `inspect` and dry runs need no torch).

Supported: int weight-only `pack-quantized` (2 to 8 bits, channel/group/tensor, sym/asym) and the
int8 `naive-quantized` / `int-quantized` layouts (of int-quantized, only the weights are read
back; its activation scheme is a runtime matter). Anything else is refused by name.

Scheme resolution follows vLLM and transformers' default path (compressed-tensors
utils/match.py): an `ignore` entry wins; then exact module names, then `re:` regexes (re.match,
anchored at the start only), then class names; alphabetical within a kind. A checkpoint holds
no module classes: a Linear class target matches every module that holds quantized tensors.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from qtool.errors import InputError
from qtool.formats.compressed_tensors import FORMAT, PACK_QUANTIZED
from qtool.io.index import INDEX_SUFFIX, load_index
from qtool.spec import PerChannel, PerGroup, PerTensor, QSpec, Scheme, StorageDtype

NAIVE_FORMATS = ("naive-quantized", "int-quantized")
READ_FORMATS = (PACK_QUANTIZED, *NAIVE_FORMATS)
STRATEGIES = ("channel", "group", "tensor")
_ARG_KEYS = frozenset(
    {"num_bits", "type", "symmetric", "group_size", "strategy", "dynamic", "block_structure",
     "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}
)  # fmt: skip


@dataclass(frozen=True)
class CtArgs:
    """The weight quantization of one config group."""

    num_bits: int
    symmetric: bool
    strategy: str  # channel | group | tensor
    group_size: int | None = None

    def describe(self) -> str:
        """'sym int4 group 128', 'asym int8 channel'."""
        kind = f"{'sym' if self.symmetric else 'asym'} int{self.num_bits}"
        return (
            f"{kind} group {self.group_size}"
            if self.strategy == "group"
            else f"{kind} {self.strategy}"
        )


@dataclass(frozen=True)
class CtGroup:
    """One config group: its name, targets, weight args and storage format."""

    name: str
    targets: tuple[str, ...]
    weights: CtArgs
    format: str


@dataclass(frozen=True)
class CtConfig:
    """The parts of a quantization_config a reader needs."""

    groups: tuple[CtGroup, ...]
    ignore: tuple[str, ...]


def config_path(path: Path) -> Path:
    """config.json of a model directory, or `path` itself when it names a config file."""
    return path / "config.json" if path.is_dir() else path


def is_compressed_tensors(path: Path) -> bool:
    """Whether `path` (a model directory or its config.json) holds a compressed-tensors model."""
    cfg = config_path(path)
    if cfg.name != "config.json" or not cfg.is_file():
        return False
    try:
        doc = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    q = doc.get("quantization_config") if isinstance(doc, dict) else None
    return isinstance(q, dict) and q.get("quant_method") == FORMAT


def read_config(path: Path) -> CtConfig:
    """The parsed quantization_config of a model directory or config.json (InputError when it
    is missing, malformed or uses a variant qtool cannot read)."""
    cfg = config_path(path)
    try:
        doc = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(cfg, f"cannot read config.json: {err}") from None
    q = doc.get("quantization_config") if isinstance(doc, dict) else None
    if not isinstance(q, dict) or q.get("quant_method") != FORMAT:
        raise InputError(cfg, "no compressed-tensors quantization_config in config.json")
    try:
        return parse_config(q)
    except ValueError as err:
        raise InputError(cfg, f"quantization_config: {err}") from None


def parse_config(q: Mapping[str, object]) -> CtConfig:
    """CtConfig from a quantization_config dict; ValueError naming what is unsupported."""
    _check_top_level(q)
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("no config_groups")
    top_format = q.get("format")
    parsed = tuple(_parse_group(str(n), g, top_format) for n, g in groups.items())
    ignore = q.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise ValueError("ignore must be a list of module names or patterns")
    return CtConfig(parsed, tuple(ignore))


def _check_top_level(q: Mapping[str, object]) -> None:
    status = q.get("quantization_status", "initialized")
    if status != "compressed":
        raise ValueError(f"quantization_status {status!r}: qtool reads compressed checkpoints only")
    if q.get("sparsity_config") or q.get("moe_sparsity_config"):
        raise ValueError("sparsity (sparsity_config) is not supported")
    if q.get("transform_config"):
        raise ValueError("transforms (transform_config, e.g. rotations) are not supported")


def _parse_group(name: str, g: object, top_format: object) -> CtGroup:
    if not isinstance(g, dict):
        raise ValueError(f"config group {name} is not an object")
    fmt = g.get("format") or top_format
    if fmt not in READ_FORMATS:
        readable = ", ".join(READ_FORMATS)
        raise ValueError(f"config group {name}: format {fmt!r} is not supported ({readable})")
    if g.get("output_activations") is not None:
        raise ValueError(f"config group {name}: output activation quantization is not supported")
    if g.get("input_activations") is not None and fmt != "int-quantized":
        raise ValueError(f"config group {name}: activation quantization is not supported")
    targets = g.get("targets")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"config group {name}: targets must be a list of strings")
    weights = g.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"config group {name}: no weights quantization")
    return CtGroup(name, tuple(targets), parse_args(name, weights, str(fmt)), str(fmt))


def parse_args(group: str, w: Mapping[str, object], fmt: str) -> CtArgs:
    """CtArgs from a `weights` dict; ValueError naming the unsupported field."""
    where = f"config group {group}"
    unknown = set(w) - _ARG_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown weights field(s) {sorted(unknown)}")
    if w.get("type", "int") != "int":
        raise ValueError(f"{where}: {w.get('type')} weights (e.g. fp8) are not supported")
    bits = w.get("num_bits", 8)
    if type(bits) is not int or not 2 <= bits <= 8:
        raise ValueError(f"{where}: {bits}-bit weights are not supported (2 to 8)")
    if fmt in NAIVE_FORMATS and bits != 8:
        raise ValueError(f"{where}: {fmt} with {bits} bits is not supported (int8 only)")
    if w.get("dynamic", False) is not False:
        raise ValueError(f"{where}: dynamic weight quantization is not supported")
    if w.get("actorder") not in (None, "static", "weight"):
        raise ValueError(f"{where}: activation ordering (actorder, g_idx) is not supported")
    if w.get("block_structure") is not None:
        raise ValueError(f"{where}: block quantization is not supported")
    group_size = w.get("group_size")
    strategy = w.get("strategy") or _inferred_strategy(group_size)
    if strategy not in STRATEGIES:
        raise ValueError(f"{where}: strategy {strategy!r} is not supported")
    size = group_size if strategy == "group" else None
    if size is not None and (type(size) is not int or size < 1):
        raise ValueError(f"{where}: group strategy needs a positive group_size")
    if strategy == "group" and size is None:
        raise ValueError(f"{where}: group strategy needs a group_size")
    symmetric = w.get("symmetric", True) is not False
    return CtArgs(bits, symmetric, str(strategy), size if isinstance(size, int) else None)


def _inferred_strategy(group_size: object) -> str:
    """compressed-tensors' inference: None -> tensor, -1 -> channel, > 0 -> group."""
    if group_size is None:
        return "tensor"
    return "channel" if group_size == -1 else "group"


# ---------------------------------------------------------------- modules and their schemes


def target_matches(target: str, module: str) -> int | None:
    """0 exact name, 1 `re:` regex, 2 a Linear class name (`Linear`, vLLM's `LinearBase`:
    every module holding quantized tensors is one); None: no match (other class names, such
    as `LayerNorm` in an ignore list, name no quantized module)."""
    if target.startswith("re:"):
        return 1 if re.match(target[3:], module) else None
    if target == module:
        return 0
    return 2 if _is_class_name(target) and "Linear" in target else None


def _is_class_name(target: str) -> bool:
    return "." not in target and target[:1].isupper()


def resolve(module: str, config: CtConfig) -> CtGroup | None:
    """The group whose scheme applies to `module`; None when `ignore` names it or nothing
    targets it. Exact names beat regexes beat class names; alphabetical within a kind."""
    if any(target_matches(i, module) is not None for i in config.ignore):
        return None
    found = [
        (kind, target, group)
        for group in config.groups
        for target in group.targets
        if (kind := target_matches(target, module)) is not None
    ]
    return min(found, key=lambda f: (f[0], f[1]))[2] if found else None


@dataclass(frozen=True)
class CtModule:
    """A quantized module found in a checkpoint's tensor names."""

    module: str
    group: CtGroup

    def tensor_names(self, present: Iterable[str]) -> dict[str, str]:
        """{local name (weight_packed, weight_scale, ...): full tensor name} of this module."""
        prefix = f"{self.module}."
        return {
            n[len(prefix) :]: n
            for n in present
            if n.startswith(prefix) and "." not in n[len(prefix) :]
        }


def quantized_modules(names: Iterable[str], config: CtConfig) -> list[CtModule]:
    """Every module holding quantized tensors (`weight_packed`, or `weight_scale` beside an
    int8 `weight`), with its resolved group; ValueError when one is not targeted by any
    group or holds a `weight_g_idx`."""
    names = set(names)
    suffixes = (".weight_packed", ".weight_scale")
    modules = sorted({n.rsplit(".", 1)[0] for n in names if n.endswith(suffixes)})
    found = []
    for m in modules:
        if f"{m}.weight_g_idx" in names:
            raise ValueError(f"{m}: activation ordering (weight_g_idx) is not supported")
        group = resolve(m, config)
        if group is None:
            raise ValueError(f"{m} holds quantized tensors but no config group targets it")
        found.append(CtModule(m, group))
    return found


def packed_words(n: int, bits: int) -> int:
    """int32 words holding n codes of `bits` bits."""
    return math.ceil(n * bits / 32)


COMPONENTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight")
"""A quantized module's tensors (`weight` holds the int8 codes of naive/int-quantized)."""


def restore_plan(names: Iterable[str], config: CtConfig) -> list[tuple[str, CtModule | None]]:
    """(output tensor name, module to dequantize into it or None to copy the tensor as is), in
    input order: a quantized module becomes one `P.weight` where its first tensor was."""
    names = list(names)
    modules = {m.module: m for m in quantized_modules(names, config)}
    plan: list[tuple[str, CtModule | None]] = []
    done: set[str] = set()
    for name in names:
        module, _, local = name.rpartition(".")
        if module in modules and local in COMPONENTS:
            if module not in done:
                plan.append((f"{module}.weight", modules[module]))
                done.add(module)
            continue
        plan.append((name, None))
    return plan


# ---------------------------------------------------------------- model directories

SINGLE_FILE = "model.safetensors"


def is_model_directory(path: Path) -> bool:
    """A directory holding a config.json and model.safetensors or an index (or that config)."""
    directory = path.parent if path.name == "config.json" else path
    if not directory.is_dir() or not (directory / "config.json").is_file():
        return False
    has_index = any(p.name.endswith(INDEX_SUFFIX) for p in directory.iterdir())
    return has_index or (directory / SINGLE_FILE).is_file()


def model_shards(directory: Path) -> list[Path]:
    """The safetensors files of a model directory: its index's shards, or model.safetensors."""
    if any(p.name.endswith(INDEX_SUFFIX) for p in directory.iterdir()):
        index = load_index(directory)
        return [index.directory / s for s in index.shards]
    return [directory / SINGLE_FILE]


def args_spec(args: CtArgs) -> QSpec:
    """The closest QSpec (qtool has int8 and int4 codes; 2-7 bits count as their container)."""
    dtype = StorageDtype.INT4 if args.num_bits <= 4 else StorageDtype.INT8
    if args.strategy == "group":
        assert args.group_size is not None
        return QSpec(
            Scheme.SYM if args.symmetric else Scheme.ASYM, dtype, PerGroup(args.group_size)
        )
    granularity = PerChannel(0) if args.strategy == "channel" else PerTensor()
    return QSpec(Scheme.SYM if args.symmetric else Scheme.ASYM, dtype, granularity)
