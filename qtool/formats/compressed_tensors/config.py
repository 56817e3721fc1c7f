"""The compressed-tensors `quantization_config` (torch-free): read exactly as compressed-tensors
reads it, and written for an export with its warnings.

Reading supports int weight-only `pack-quantized` (2 to 8 bits, channel/group/tensor, sym/asym)
and the int8 `naive-quantized` / `int-quantized` layouts (of int-quantized, only the weights are
read back; its activation scheme is a runtime matter). Anything else is refused by name.

Writing follows shared/research/groups-clipping-export.md section 3.2 and the traps measured in
notes/compressed-tensors.md: explicit `weights` args, `format` at the top level and in every
group (transformers' dequantize=True path needs it), `quantization_status: compressed` (without
it transformers' default path silently loads random weights), every float Linear in `ignore`,
specific groups (exact module names) before the `Linear` catch-all (trap T4), per tensor written
as channel with the scale repeated (vLLM has no weight-only int tensor strategy).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from qtool.calibration import TEXTS_KEY, TextUse, texts_json
from qtool.errors import InputError
from qtool.formats import stale_config
from qtool.formats.compressed_tensors import coerce
from qtool.formats.compressed_tensors.selection import (
    FORMAT,
    PACK_QUANTIZED,
    Selection,
    check_spec,
    ignore_list,
    literal_target,
)
from qtool.spec import (
    MSE_ALGORITHM,
    SEMANTICS,
    PerGroup,
    QSpec,
    RangeMethod,
    Scheme,
)

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


def quantization_config_of(doc: object) -> Mapping[str, object] | None:
    """config.json's compressed-tensors quantization_config, None when it has none."""
    q = doc.get("quantization_config") if isinstance(doc, dict) else None
    return q if isinstance(q, dict) and q.get("quant_method") == FORMAT else None


def read_config(doc: object, path: Path) -> CtConfig:
    """The parsed quantization_config of config.json's content `doc` (read by detect, through
    the model directory's descriptor); InputError naming `path` when it is missing, malformed
    or uses a variant qtool cannot read."""
    q = quantization_config_of(doc)
    if q is None:
        raise InputError(path, "no compressed-tensors quantization_config in config.json")
    try:
        return parse_config(q)
    except ValueError as err:
        raise InputError(path, f"quantization_config: {err}") from None


def parse_config(q: Mapping[str, object]) -> CtConfig:
    """CtConfig from a quantization_config dict, read exactly as compressed-tensors' pydantic
    models read it (coerce.py: `"false"` is False, `"4"` is 4, what they refuse is refused);
    ValueError naming what is invalid or what qtool does not support."""
    if q.get("sparsity_config") or q.get("moe_sparsity_config"):
        raise ValueError("sparsity (sparsity_config) is not supported")
    if q.get("transform_config"):
        raise ValueError("transforms (transform_config, e.g. rotations) are not supported")
    config = coerce.quantization_config(q)
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
        args = coerce.quantization_args(w)
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


# ---------------------------------------------------------------- writing


def check_not_quantized(config: Mapping[str, object], path: Path) -> None:
    """InputError when config.json already carries a quantization_config (naming its
    quant_method and how to remove the key)."""
    if config.get("quantization_config") is not None:
        raise stale_config.refusal(config, path)


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
    *,
    absent: Sequence[str] = (),
    dequantize: bool = False,
    imatrix: Mapping[str, object] | None = None,
    texts: Sequence[TextUse] = (),
) -> dict[str, object]:
    """The `quantization_config` of config.json; `candidates` (name -> multipliers) records
    the mse search's candidate lists under the `qtool` key, which loaders ignore; `absent`: the
    Linears the checkpoint holds no weight for (ignored too); `dequantize` writes
    `"dequantize": true`, which makes transformers dequantize at load time
    (loaders.dequantize_at_load says when); `imatrix`: the provenance of the importance matrix
    the range search was weighted by, and `texts` (calibration.TEXTS_KEY), the texts a method or
    an imatrix used, recorded under the `qtool` key too."""
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
    if imatrix is not None:
        record["imatrix"] = dict(imatrix)
    if texts:
        record[TEXTS_KEY] = texts_json(texts)
    q: dict[str, object] = {
        "quant_method": FORMAT,
        "format": PACK_QUANTIZED,
        "quantization_status": "compressed",
        "config_groups": config_groups(selections),
        "ignore": ignore_list(selections, absent),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "qtool": record,
    }
    if dequantize:
        q["dequantize"] = True
    return q


def with_quantization_config(
    config: Mapping[str, object], qconfig: Mapping[str, object], path: Path
) -> dict[str, object]:
    """config.json's content with `quantization_config` added (InputError if it had one)."""
    check_not_quantized(config, path)
    return {**config, "quantization_config": dict(qconfig)}
