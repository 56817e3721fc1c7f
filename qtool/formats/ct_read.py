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

import math
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from qtool import patterns
from qtool.errors import InputError
from qtool.formats import ct_coerce
from qtool.formats.compressed_tensors import FORMAT, PACK_QUANTIZED
from qtool.io.index import INDEX_SUFFIX, load_index
from qtool.io.jsonfile import read_json
from qtool.io.safeopen import InputDir
from qtool.spec import PerChannel, PerGroup, PerTensor, QSpec, Scheme, StorageDtype

NAIVE_FORMATS = ("naive-quantized", "int-quantized")
READ_FORMATS = (PACK_QUANTIZED, *NAIVE_FORMATS)
STRATEGIES = ("channel", "group", "tensor")


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


def is_compressed_tensors(path: Path, within: InputDir | None = None) -> bool:
    """Whether `path` (a model directory or its config.json) holds a compressed-tensors model.
    config.json is read like every config (jsonfile: regular file inside the directory,
    bounded, strict); one that cannot be read says no here, and is refused when it is read,
    unless the directory holds no index either: then nothing else could read it, and the
    config's own error (a FIFO, too deep, too big) is the one worth showing."""
    cfg = config_path(path)
    if cfg.name != "config.json":
        return False
    try:
        directory = within or InputDir(cfg.parent)
        st = directory.lstat(cfg.name)
        if st is None or stat.S_ISDIR(st.st_mode):
            return False
        doc = read_json(cfg, within=directory, what="config.json")
    except InputError:
        if path.is_dir() and not any(n.endswith(INDEX_SUFFIX) for n in directory.names()):
            raise
        return False
    q = doc.get("quantization_config") if isinstance(doc, dict) else None
    return isinstance(q, dict) and q.get("quant_method") == FORMAT


def read_config(path: Path, within: InputDir | None = None) -> CtConfig:
    """The parsed quantization_config of a model directory or config.json (InputError when it
    is missing, malformed or uses a variant qtool cannot read), read through the directory's
    descriptor (`within`, or opened here)."""
    cfg = config_path(path)
    doc = read_json(cfg, within=within or InputDir(cfg.parent), what="config.json")
    q = doc.get("quantization_config") if isinstance(doc, dict) else None
    if not isinstance(q, dict) or q.get("quant_method") != FORMAT:
        raise InputError(cfg, "no compressed-tensors quantization_config in config.json")
    try:
        return parse_config(q)
    except ValueError as err:
        raise InputError(cfg, f"quantization_config: {err}") from None


def parse_config(q: Mapping[str, object]) -> CtConfig:
    """CtConfig from a quantization_config dict, read exactly as compressed-tensors' pydantic
    models read it (ct_coerce: `"false"` is False, `"4"` is 4, what they refuse is refused);
    ValueError naming what is invalid or what qtool does not support."""
    if q.get("sparsity_config") or q.get("moe_sparsity_config"):
        raise ValueError("sparsity (sparsity_config) is not supported")
    if q.get("transform_config"):
        raise ValueError("transforms (transform_config, e.g. rotations) are not supported")
    config = ct_coerce.quantization_config(q)
    status = config["quantization_status"]
    if status != "compressed":
        raise ValueError(f"quantization_status {status!r}: qtool reads compressed checkpoints only")
    groups = config["config_groups"]
    assert isinstance(groups, dict)
    top_format = config["format"]
    parsed = tuple(_parse_group(n, g, top_format) for n, g in groups.items())
    ignore = config["ignore"]
    assert isinstance(ignore, list)
    return CtConfig(parsed, tuple(ignore))


def _parse_group(name: str, g: dict[str, object], top_format: object) -> CtGroup:
    fmt = g["format"] or top_format
    if fmt not in READ_FORMATS:
        readable = ", ".join(READ_FORMATS)
        raise ValueError(f"config group {name}: format {fmt!r} is not supported ({readable})")
    if g["output_activations"] is not None:
        raise ValueError(f"config group {name}: output activation quantization is not supported")
    if g["input_activations"] is not None and fmt != "int-quantized":
        raise ValueError(f"config group {name}: activation quantization is not supported")
    weights = g["weights"]
    if not isinstance(weights, dict):
        raise ValueError(f"config group {name}: no weights quantization")
    targets = g["targets"]
    assert isinstance(targets, list)
    return CtGroup(name, tuple(targets), _supported(name, weights, str(fmt)), str(fmt))


def parse_args(group: str, w: Mapping[str, object], fmt: str) -> CtArgs:
    """CtArgs from a `weights` dict, coerced as compressed-tensors does (ValueError naming the
    invalid or unsupported field)."""
    try:
        args = ct_coerce.quantization_args(w)
    except ValueError as err:
        raise ValueError(f"config group {group} weights: {err}") from None
    return _supported(group, args, fmt)


def _supported(group: str, w: Mapping[str, object], fmt: str) -> CtArgs:
    """CtArgs from coerced args; ValueError for what qtool does not read."""
    where = f"config group {group}"
    if w["type"] != "int":
        raise ValueError(f"{where}: {w['type']} weights (e.g. fp8) are not supported")
    bits = w["num_bits"]
    assert isinstance(bits, int)
    if not 2 <= bits <= 8:
        raise ValueError(f"{where}: {bits}-bit weights are not supported (2 to 8)")
    if fmt in NAIVE_FORMATS and bits != 8:
        raise ValueError(f"{where}: {fmt} with {bits} bits is not supported (int8 only)")
    if w["dynamic"] is not False:
        raise ValueError(f"{where}: dynamic weight quantization is not supported")
    if w["actorder"] not in (None, False, "static", "weight"):
        raise ValueError(f"{where}: activation ordering (actorder, g_idx) is not supported")
    if w["block_structure"] is not None:
        raise ValueError(f"{where}: block quantization is not supported")
    strategy = w["strategy"]
    if strategy not in STRATEGIES:
        raise ValueError(f"{where}: strategy {strategy!r} is not supported")
    size = w["group_size"] if strategy == "group" else None
    assert size is None or isinstance(size, int)
    return CtArgs(bits, bool(w["symmetric"]), str(strategy), size)


# ---------------------------------------------------------------- modules and their schemes


def target_matches(target: str, module: str) -> int | None:
    """0 exact name, 1 `re:` regex, 2 a Linear class name (`Linear`, vLLM's `LinearBase`:
    every module holding quantized tensors is one); None: no match (other class names, such
    as `LayerNorm` in an ignore list, name no quantized module)."""
    if target.startswith("re:"):  # bounded: a pattern from a file cannot hang qtool
        return 1 if patterns.matches(target[3:], module) else None
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
    with patterns.bounded():
        for m in modules:
            found.append(_quantized_module(m, names, config))
    return found


def _quantized_module(m: str, names: set[str], config: CtConfig) -> CtModule:
    if f"{m}.weight_g_idx" in names:
        raise ValueError(f"{m}: activation ordering (weight_g_idx) is not supported")
    group = resolve(m, config)
    if group is None:
        raise ValueError(f"{m} holds quantized tensors but no config group targets it")
    return CtModule(m, group)


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


def model_shards(directory: Path, within: InputDir | None = None) -> list[Path]:
    """The safetensors files of a model directory: its index's shards, or model.safetensors
    (listed and validated through the directory's descriptor, `within` or opened here)."""
    within = within or InputDir(directory)
    if any(n.endswith(INDEX_SUFFIX) for n in within.names()):
        index = load_index(directory, within)
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
