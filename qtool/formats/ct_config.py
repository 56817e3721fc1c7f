"""The compressed-tensors `quantization_config` of an export, and its warnings (torch-free).

Follows shared/research/groups-clipping-export.md section 3.2 and the traps measured in
notes/compressed-tensors.md: explicit `weights` args, `format` at the top level and in every
group (transformers' dequantize=True path needs it), `quantization_status: compressed` (without
it transformers' default path silently loads random weights), every float Linear in `ignore`,
specific groups (exact module names) before the `Linear` catch-all (trap T4), per tensor written
as channel with the scale repeated (vLLM has no weight-only int tensor strategy).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from qtool.errors import InputError
from qtool.formats.compressed_tensors import (
    FORMAT,
    PACK_QUANTIZED,
    VLLM_GROUP_SIZES,
    Selection,
    check_spec,
    ignore_list,
    literal_target,
)
from qtool.spec import MSE_ALGORITHM, SEMANTICS, PerGroup, QSpec, RangeMethod, Scheme, StorageDtype


def check_not_quantized(config: Mapping[str, object], path: Path) -> None:
    """InputError when config.json already carries a quantization_config."""
    if config.get("quantization_config") is not None:
        raise InputError(
            path,
            "already quantized: config.json has a quantization_config; "
            "quantize the original float checkpoint instead",
        )


def weights_args(spec: QSpec) -> dict[str, object]:
    """compressed-tensors QuantizationArgs for `spec`, every field explicit (per tensor is
    written as channel: vLLM refuses the tensor strategy for weight-only int)."""
    check_spec(spec)
    g = spec.granularity
    group = isinstance(g, PerGroup)
    return {
        "num_bits": spec.dtype.bits,
        "type": "int",
        "symmetric": spec.scheme is Scheme.SYM,
        "strategy": "group" if group else "channel",
        "group_size": g.size if isinstance(g, PerGroup) else None,
        "dynamic": False,
    }


def _group(targets: list[str], args: dict[str, object]) -> dict[str, object]:
    return {
        "targets": targets,
        "weights": args,
        "input_activations": None,
        "output_activations": None,
        "format": PACK_QUANTIZED,
    }


def config_groups(selections: Iterable[Selection]) -> dict[str, dict[str, object]]:
    """One group per distinct weights args: the most common one targets `Linear` and comes
    last; the others target their modules by exact name and come first (trap T4)."""
    modules: dict[tuple[tuple[str, object], ...], list[str]] = {}
    for s in selections:
        if s.spec is not None and s.module is not None:
            key = tuple(weights_args(s.spec).items())
            modules.setdefault(key, []).append(s.module)
    if not modules:
        return {}
    counts = Counter({key: len(names) for key, names in modules.items()})
    catch_all = counts.most_common(1)[0][0]
    ordered = [key for key in modules if key != catch_all] + [catch_all]
    return {
        f"group_{i}": _group(
            ["Linear"] if key == catch_all else [literal_target(m) for m in modules[key]], dict(key)
        )
        for i, key in enumerate(ordered)
    }


def quantization_config(
    selections: Sequence[Selection],
    version: str,
    candidates: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, object]:
    """The `quantization_config` of config.json; `candidates` (name -> multipliers) records
    the mse search's candidate lists under the `qtool` key, which loaders ignore."""
    specs = [s.spec for s in selections if s.spec is not None]
    methods = sorted({s.range_method.value for s in specs})
    record: dict[str, object] = {
        "version": version,
        "semantics": SEMANTICS,
        "range_method": methods,
    }
    if RangeMethod.MSE.value in methods:
        record["mse_algorithm"] = MSE_ALGORITHM
        record["mse_candidates"] = {k: list(v) for k, v in (candidates or {}).items()}
    return {
        "quant_method": FORMAT,
        "format": PACK_QUANTIZED,
        "quantization_status": "compressed",
        "config_groups": config_groups(selections),
        "ignore": ignore_list(selections),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "qtool": record,
    }


def with_quantization_config(
    config: Mapping[str, object], qconfig: Mapping[str, object], path: Path
) -> dict[str, object]:
    """config.json's content with `quantization_config` added (InputError if it had one)."""
    check_not_quantized(config, path)
    return {**config, "quantization_config": dict(qconfig)}


# ---------------------------------------------------------------- warnings


def export_warnings(selections: Sequence[Selection]) -> list[str]:
    """One line per choice that will not run everywhere (vLLM kernels, transformers paths)."""
    specs = {s.spec for s in selections if s.spec is not None}
    warnings = []
    if any(s.scheme is Scheme.ASYM and s.dtype is StorageDtype.INT8 for s in specs):
        warnings.append(
            "asymmetric int8 runs on few vLLM kernels (Hopper/Machete, or Conch); "
            "symmetric int8 runs on Marlin and Machete"
        )
    odd = sorted(
        {
            s.granularity.size
            for s in specs
            if isinstance(s.granularity, PerGroup) and s.granularity.size not in VLLM_GROUP_SIZES
        }
    )
    if odd:
        sizes = ", ".join(map(str, odd))
        warnings.append(f"group size {sizes}: vLLM has kernels for groups of 32, 64 and 128 only")
    asym = any(s.scheme is Scheme.ASYM for s in specs)
    if asym and len(config_groups(selections)) > 1:
        warnings.append(
            "asymmetric with several schemes (e.g. a group fallback): transformers 5.23 with "
            "compressed-tensors 0.20 has no path that loads it correctly; vLLM and qtool read it"
        )
    if asym:
        warnings.append(
            "asymmetric: transformers loads it only with "
            "CompressedTensorsConfig(dequantize=True) (compressed-tensors 0.20 zero-point bug)"
        )
    return warnings
