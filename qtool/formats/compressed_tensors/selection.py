"""compressed-tensors export, planned from headers and config.json alone (torch-free).

Which tensors: the 2-D `.weight` of every Linear layer, decided from names, shapes and
config.json (a checkpoint holds no module types). Embeddings, norms, Conv1D/conv weights and 3-D
fused experts are not Linear layers and stay float; the output head (`lm_head`, a head tied to
the input embeddings) and MoE routers/gates are Linear layers kept float by default, and every
Linear kept float goes into `ignore` by its exact module name. Also here: the group-size checks
and fallback, the fused-set check, and the tensors each quantized Linear becomes (for dry runs
and the index). config.py writes the quantization_config; codec.py encodes the tensors.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from qtool.dtypes import DTYPE_BITS, FLOAT_DTYPES, non_float_reason
from qtool.formats.base import Ruled
from qtool.formats.compressed_tensors.modules import OUTPUT_HEADS, TIED_HEADS, Linears
from qtool.io.stformat import TensorEntry
from qtool.spec import (
    FormatName,
    PerChannel,
    PerGroup,
    QSpec,
    Scheme,
    StorageDtype,
    as_grid,
)

FORMAT = FormatName.COMPRESSED_TENSORS.value
PACK_QUANTIZED = "pack-quantized"
SUPPORTED_DTYPES = (StorageDtype.INT8, StorageDtype.INT4)
"""compressed-tensors stores signed codes and zero points; qtool's uint8/uint4 are refused."""
VLLM_GROUP_SIZES = (32, 64, 128)
FUSED_SETS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),
)
"""Sibling Linears vLLM merges into one layer (qkv_proj, gate_up_proj, Mixtral w13)."""
CONV1D_MODEL_TYPES = ("gpt2", "openai-gpt", "imagegpt", "decision_transformer")
"""Models whose 2-D projection weights belong to transformers' Conv1D, not nn.Linear."""

_EMBEDDING = re.compile(r"^(wte|wpe|shared)$|embed(dings?|_tokens|_positions)?$")
_NORM = re.compile(r"norm", re.IGNORECASE)
_ROUTER_PARTS = frozenset({"gate", "router", "shared_expert_gate", "gating", "gate_network"})


@dataclass(frozen=True)
class Selection:
    """One tensor's fate in a compressed-tensors export.

    `module` is the Linear's module name when the tensor is a Linear weight (None otherwise);
    `spec` is None when the tensor is kept as is, with `reason` saying why; `note` says how
    the spec was adapted (group fallback).
    """

    entry: TensorEntry
    module: str | None
    spec: QSpec | None
    reason: str = ""
    note: str = ""

    @property
    def quantized(self) -> bool:
        return self.spec is not None

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in the export (header excluded)."""
        return output_nbytes(self)

    @property
    def stored_dtype(self) -> str:
        """I32 (packed codes) when quantized, else the tensor's dtype."""
        return "I32" if self.spec is not None else self.entry.dtype


# ---------------------------------------------------------------- which tensors


@dataclass(frozen=True)
class Kind:
    """What a tensor is to the export: `module` names the Linear whose weight it is (None:
    not a Linear weight); `reason` says why it stays float by default ("" : quantized);
    `fixed` when no --include can change that."""

    module: str | None
    reason: str = ""
    fixed: bool = False


def classify(
    entry: TensorEntry, config: Mapping[str, object], linears: Linears | None = None
) -> Kind:
    """Whether `entry` is the weight of a Linear layer, and whether it is quantized by default:
    by its name, shape and config.json, corrected by the model's module list when it is known
    (modules.py: a weight of no nn.Linear is never quantized; an nn.Linear the rules take for
    something else stays float and goes into `ignore`)."""
    kind = _by_name(entry, config)
    if linears is None or len(entry.shape) != 2 or not entry.name.endswith(".weight"):
        return kind
    module = entry.name[: -len(".weight")]
    linear = linears.is_linear(module)
    if linear is False and kind.module is not None:
        what = linears.class_of(module)
        return Kind(None, f"not an nn.Linear in {linears.how} ({what})", True)
    if linear and kind.module is None:
        return Kind(module, kind.reason, kind.fixed)
    return kind


def _by_name(entry: TensorEntry, config: Mapping[str, object]) -> Kind:
    name, ndim = entry.name, len(entry.shape)
    if entry.dtype not in FLOAT_DTYPES:
        return Kind(None, non_float_reason(entry.dtype), True)
    if ndim == 3:
        return Kind(None, "3-D (fused MoE experts): not a Linear weight", True)
    if ndim != 2:
        what = {0: "0-d scalar", 1: "1-D (bias/norm)"}.get(ndim, f"{ndim}-D (conv weight)")
        return Kind(None, what, True)
    if not name.endswith(".weight"):
        return Kind(None, "not a .weight tensor", True)
    module = name[: -len(".weight")]
    parts = module.split(".")
    if _NORM.search(parts[-1]):
        return Kind(None, "norm weight", True)
    if _is_output_head(parts, entry.shape, config):
        if _tied(config):
            return Kind(module, "output head tied to the input embeddings", True)
        return Kind(module, f"output head ({parts[-1]})")
    if _EMBEDDING.search(parts[-1]):
        return Kind(None, "embedding", True)
    if config.get("model_type") in CONV1D_MODEL_TYPES:
        return Kind(None, "Conv1D (GPT-2 style, transposed weight): not an nn.Linear", True)
    if any(p in _ROUTER_PARTS or p.endswith("router") for p in parts):
        return Kind(module, "MoE router/gate")
    return Kind(module)


def _is_output_head(parts: list[str], shape: tuple[int, ...], config: Mapping[str, object]) -> bool:
    if parts[-1] in OUTPUT_HEADS:
        return True
    vocab = config.get("vocab_size")
    return parts[-1] in TIED_HEADS and isinstance(vocab, int) and shape[0] == vocab


def _tied(config: Mapping[str, object]) -> bool:
    """transformers ties input and output embeddings unless the config says otherwise."""
    return config.get("tie_word_embeddings", True) is not False


def select_planned(
    planned: Iterable[Ruled], config: Mapping[str, object], linears: Linears | None = None
) -> list[Selection]:
    """The fate of every tensor, in order, given the rules' plan (--exclude, a recipe,
    --include): compressed-tensors quantizes Linear weights only, so every other tensor stays
    float whatever rule named it, and a Linear kept by default (lm_head, a router, never a
    tied head) is quantized only when a rule names it. ValueError for a spec it cannot store."""
    return [_select_one(p, config, linears) for p in planned]


def _select_one(planned: Ruled, config: Mapping[str, object], linears: Linears | None) -> Selection:
    """The export takes the spec as asked: a group longer than a row breaks K like any other
    group that does not divide it (see GroupFallback)."""
    entry, spec, ruling = planned.entry, planned.spec, planned.decision
    note = ruling.note
    if spec is not None and ruling.asked is not None and ruling.asked != spec:
        spec, note = ruling.asked, ""  # qtool's fitting note no longer applies
    kind = classify(entry, config, linears)
    if spec is None:
        reason = ruling.reason if ruling.by_name else kind.reason or ruling.reason
        return Selection(entry, kind.module, None, reason)
    if kind.fixed or (kind.reason and not ruling.by_name):
        return Selection(entry, kind.module, None, _why_kept(kind, ruling.by_name))
    spec = as_grid(spec)  # the registry lets only grids reach this format
    try:
        check_spec(spec)
    except ValueError as err:
        if not ruling.rule_label:
            raise
        where = f"{ruling.rule_origin}{ruling.rule_label}"
        raise RuleUnstorable(f"{where} (for {entry.name}): {err}") from None
    return Selection(entry, kind.module, spec, note=note)


def _why_kept(kind: Kind, asked: bool) -> str:
    """Why a tensor stays float; when a rule asked a spec for it, why the format cannot store
    one (a recipe's int8 rule for BERT's word_embeddings became "kept: embedding", silently)."""
    if not asked or kind.module is not None or "nn.Linear" in kind.reason:
        return kind.reason
    why = f"{kind.reason}: compressed-tensors quantizes nn.Linear weights only"
    if kind.reason == "embedding":  # tests/interop/test_ct_quantized_embedding.py
        why += (" (transformers and vLLM load no quantized embedding from it; the qtool and "
                "GGUF formats quantize embeddings)")  # fmt: skip
    return why


class RuleUnstorable(ValueError):
    """A recipe rule gives a Linear a spec compressed-tensors cannot store."""


def fused_key(module: str) -> str | None:
    """'model.layers.0.self_attn.{q_proj,k_proj,v_proj}' for a member of a set vLLM fuses."""
    parent, _, leaf = module.rpartition(".")
    fused = next((f for f in FUSED_SETS if leaf in f), None)
    return None if fused is None else f"{parent}.{{{','.join(fused)}}}"


def check_spec(spec: QSpec) -> None:
    """ValueError unless compressed-tensors can store `spec` (signed codes, output channels)."""
    if spec.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"compressed-tensors stores signed codes: use int8 or int4, not {spec.dtype.value}"
        )
    g = spec.granularity
    if isinstance(g, PerChannel) and g.axis not in (0, -2):
        raise ValueError("compressed-tensors scales run along output channels (axis 0) only")


def ignore_list(selections: Iterable[Selection], absent: Iterable[str] = ()) -> list[str]:
    """Every Linear kept in float, by exact module name (literal_target), sorted; `absent`: the
    Linears the checkpoint holds no weight for (a tied output head), kept float too."""
    kept = {s.module for s in selections if s.module is not None and s.spec is None}
    return sorted(literal_target(m) for m in kept | set(absent))


def literal_target(module: str) -> str:
    """A target (or ignore entry) compressed-tensors reads as exactly this module name: a name
    it would read otherwise (`re:...` is a regex to it; a dot-less capitalised name such as
    `Linear` is a class name) is written as an anchored, escaped regex."""
    if module.startswith("re:") or ("." not in module and module[:1].isupper()):
        return "re:" + re.escape(module) + r"\Z"
    return module


def fused_inconsistencies(selections: Iterable[Selection]) -> list[str]:
    """One line per set of sibling Linears vLLM fuses (q/k/v, gate/up, w1/w3) whose members
    are not treated alike (different specs, or some kept float); [] when the plan is fine."""
    by_parent: dict[tuple[str, tuple[str, ...]], dict[str, QSpec | None]] = {}
    for s in selections:
        if s.module is None:
            continue
        parent, _, leaf = s.module.rpartition(".")
        for fused in FUSED_SETS:
            if leaf in fused:
                by_parent.setdefault((parent, fused), {})[leaf] = s.spec
    problems = []
    for (parent, fused), members in by_parent.items():
        if len(set(members.values())) > 1:
            described = ", ".join(f"{leaf}: {_label(members[leaf])}" for leaf in members)
            problems.append(f"{parent}.{{{','.join(fused)}}} differ ({described})")
    return problems


def _label(spec: QSpec | None) -> str:
    return spec.describe() if spec is not None else "float"


# ---------------------------------------------------------------- output tensors


def output_tensors(selection: Selection) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (safetensors dtype, shape)} the export writes for this tensor."""
    e, spec = selection.entry, selection.spec
    if spec is None or selection.module is None:
        return {e.name: (e.dtype, e.shape)}
    n, k = e.shape
    bits = spec.dtype.bits
    groups = k // spec.granularity.size if isinstance(spec.granularity, PerGroup) else 1
    p = selection.module
    out: dict[str, tuple[str, tuple[int, ...]]] = {
        f"{p}.weight_packed": ("I32", (n, math.ceil(k * bits / 32))),
        f"{p}.weight_scale": (e.dtype, (n, groups)),
    }
    if spec.scheme is Scheme.ASYM:
        out[f"{p}.weight_zero_point"] = ("I32", (math.ceil(n * bits / 32), groups))
    out[f"{p}.weight_shape"] = ("I64", (2,))
    return out


def output_nbytes(selection: Selection) -> int:
    """Bytes this tensor takes in the export (header excluded)."""
    return sum(
        math.prod(shape) * DTYPE_BITS[dtype] // 8
        for dtype, shape in output_tensors(selection).values()
    )
