"""Which scheme applies to each quantized module of a compressed-tensors checkpoint (torch-free).

Scheme resolution follows vLLM and transformers' default path (compressed-tensors
utils/match.py): an `ignore` entry wins; then exact module names, then `re:` regexes (re.match,
anchored at the start only), then class names; alphabetical within a kind. A checkpoint holds
no module classes: a Linear class target matches every module that holds quantized tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from qtool import patterns
from qtool.formats.compressed_tensors.config import CtArgs, CtConfig, CtGroup
from qtool.spec import PerChannel, PerGroup, PerTensor, QSpec, Scheme, StorageDtype


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
