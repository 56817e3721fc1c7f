"""QUANT, the model under test, loaded once into FLOAT's architecture by the first loader that
claims it (LOADERS, in order):

- a compressed-tensors model directory (whoever wrote it) is loaded by transformers itself, as
  a user would serve it: the default path, or `dequantize=True` for asymmetric schemes (the
  default path cannot load those: docs/formats.md), then its weights are checked to be there.
  Its tensors as stored are read by qtool (through the directory's descriptor) and handed to
  transformers as a state dict with the config qtool read: transformers opens no file of it;
- anything else qtool reads (a qtool-quantized file with its sidecar, a sharded set, a float
  checkpoint or model directory) is read through qtool's readers, dequantized in memory to the
  dtype a consumer restores, and loaded into FLOAT's architecture by transformers (never
  written to disk).

A GGUF loader (issue 23) plugs in as one more QuantLoader: its tensors under FLOAT's names go
through `into_float_architecture` like qtool's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from qtool.calibration import TextUse
from qtool.dtypes import FLOAT_DTYPES
from qtool.engine.model import hf
from qtool.engine.model.models import FloatModel, listed, loading_problem
from qtool.engine.model.readers import read_tensors
from qtool.engine.source import Source
from qtool.errors import InputError
from qtool.formats.detect import Detected, detect
from qtool.formats.provenance import recorded_texts
from qtool.formats.registry import entry

# config keys that say nothing about the architecture (or are checked another way)
CONFIG_NOISE = frozenset(
    {
        "quantization_config", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
        "use_cache", "output_attentions", "output_hidden_states", "return_dict",
        "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id",
        "chunk_size_feed_forward", "problem_type", "id2label", "label2id", "tokenizer_class",
    }
)  # fmt: skip


@dataclass(frozen=True)
class QuantModel:
    model: Any  # in eval mode, in the compute dtype
    loaded_as: str
    tokenizer: hf.Tokenizer | None  # QUANT's own tokenizer, when its directory has one
    texts: tuple[TextUse, ...] = ()  # the texts its quantization recorded (formats/provenance)


@dataclass(frozen=True)
class QuantLoader:
    claims: Callable[[Detected], bool]
    load: Callable[[Detected, FloatModel, torch.dtype], QuantModel]


def load_quant(path: Path, reference: FloatModel, dtype: torch.dtype) -> QuantModel:
    """QUANT in FLOAT's architecture and `dtype` (InputError when it is not the same model)."""
    found = detect(path)  # InputError for a path that does not exist or holds no checkpoint
    loader = next(loader for loader in LOADERS if loader.claims(found))
    return replace(loader.load(found, reference, dtype), texts=recorded_texts(found))


# ---- compressed-tensors: transformers loads it ---------------------------------------------


def _is_ct(found: Detected) -> bool:
    """A model directory transformers loads itself (registry: FormatEntry.transformers_loads)."""
    return entry(found.format).transformers_loads and found.directory is not None


def _load_ct(found: Detected, reference: FloatModel, dtype: torch.dtype) -> QuantModel:
    assert found.directory is not None
    path = found.directory
    config = check_same_architecture(reference, found)
    tensors, files = _stored_tensors(found)
    _check_stored_shapes(tensors, files, reference)
    kwargs: dict[str, Any] = {}
    how = "compressed-tensors, loaded by transformers"
    qconfig = _quantization_config(found)
    if _asymmetric(path, qconfig):
        kwargs["quantization_config"] = hf.transformers_module().CompressedTensorsConfig(
            dequantize=True
        )
        how += " (dequantize=True: asymmetric)"
    # its own dtype: the weights are (q - z) * s rounded as every consumer rounds them
    try:
        model, info = hf.from_pretrained(
            type(reference.model), path, "QUANT", config=config, state_dict=tensors, **kwargs
        )
    except InputError as err:
        hint = _tied_hint(reference.model, qconfig)
        raise InputError(path, f"{err.message}{hint}") from None
    del tensors
    problem = loading_problem(info, reference.unexpected)
    if problem:
        raise InputError(path, f"QUANT {problem}")
    _decompress(model, path, reference, qconfig)
    return QuantModel(model.to(dtype).eval(), how, own_tokenizer(path, config))


def _stored_tensors(found: Detected) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """Every tensor of the export as stored (packed codes, scales, shapes), read through the
    directory's descriptor by qtool's safetensors reader (and the file of each): transformers
    is handed them as a state dict and never opens a file of QUANT's directory."""
    source = Source(found)
    tensors: dict[str, torch.Tensor] = {}
    files: dict[str, Path] = {}
    for shard in source.shards:
        checkpoint = source.checkpoint(shard)
        try:
            for entry, t in zip(checkpoint.entries, checkpoint.tensors(checkpoint.entries),
                                strict=True):  # fmt: skip
                if entry.name in tensors:
                    raise InputError(shard, "holds a tensor another shard holds too", entry.name)
                tensors[entry.name], files[entry.name] = t, shard
            checkpoint.check_unchanged()
        finally:
            checkpoint.close()
    return tensors, files


def _check_stored_shapes(
    tensors: dict[str, torch.Tensor], files: dict[str, Path], reference: FloatModel
) -> None:
    """The export's tensors have FLOAT's shapes: a tensor kept float its own, a packed Linear
    the shape its `weight_shape` records (InputError naming the tensor, both files and both
    shapes; transformers would only say "look at the above report!")."""
    want = reference.checkpoint
    for stored, t in tensors.items():
        name = stored
        if name.endswith(".weight_shape") and t.dim() == 1 and not t.is_floating_point():
            name, shape = name.removesuffix("_shape"), tuple(int(v) for v in t.tolist())
        else:
            shape = tuple(t.shape)
        theirs = want.tensors.get(name)
        if theirs is not None and theirs[0] != shape:
            ours = want.files.get(name, reference.path)
            raise InputError(
                files[stored],
                f"not FLOAT's model: {name} is {list(shape)} here but {list(theirs[0])} in "
                f"FLOAT's {ours}", name,
            )  # fmt: skip


def _quantization_config(found: Detected) -> dict[str, Any]:
    """config.json's quantization_config as detect read it (through the directory's
    descriptor); only the keys transformers' loading paths depend on are looked at here."""
    config = found.config if isinstance(found.config, dict) else {}
    q = config.get("quantization_config")
    return q if isinstance(q, dict) else {}


def _asymmetric(path: Path, config: dict[str, Any]) -> bool:
    """True for a single-scheme asymmetric export (which loads only with dequantize=True);
    InputError for a mixed-scheme asymmetric one, which has no working transformers path
    (dequantize=True applies the first config group to every module)."""
    groups = config.get("config_groups")
    weights = [g.get("weights") for g in groups.values()] if isinstance(groups, dict) else []
    if not any(isinstance(w, dict) and w.get("symmetric") is False for w in weights):
        return False
    if len(weights) > 1:
        raise InputError(
            path, "an asymmetric compressed-tensors model with several schemes: transformers "
            "loads it on no path (docs/formats.md); evaluate its float copy (qtool dequantize)",
        )  # fmt: skip
    return True


def _decompress(model: Any, path: Path, reference: FloatModel, config: dict[str, Any]) -> None:
    """compressed-tensors decompresses the weights on the first forward: run one token, then
    check that every Linear holds float weights."""
    with torch.no_grad(), hf.quiet():  # not inference_mode: the weights stay parameters
        try:
            model(input_ids=torch.zeros(1, 1, dtype=torch.long))
        except (RuntimeError, AttributeError, ValueError, TypeError) as err:
            raise InputError(
                path, f"transformers loaded QUANT but cannot run it: {hf.first_line(err)}"
                f"{_tied_hint(reference.model, config)}",
            ) from None  # fmt: skip
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and not _is_float(weight):
            raise InputError(path, f"QUANT's Linear {name} has no float weight after loading")


def _tied_hint(model: Any, config: dict[str, Any]) -> str:
    """Why a tied-head export fails to load: its `ignore` must name the head."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return ""
    ignore = config.get("ignore")
    if any("lm_head" in str(entry) for entry in (ignore if isinstance(ignore, list) else [])):
        return ""
    return (
        "; its output head is tied to the embeddings but quantization_config.ignore lacks "
        '"lm_head" (exports of qtool 0.1 miss it): add it to ignore'
    )


def _is_float(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


# ---- anything qtool reads: dequantized in memory ---------------------------------------------


def _load_tensors(found: Detected, reference: FloatModel, dtype: torch.dtype) -> QuantModel:
    path = found.named
    if found.directory is not None and found.config is not None:
        check_same_architecture(reference, found)
    tensors, quantized = read_tensors(found, list(reference.checkpoint.tensors))
    model = into_float_architecture(tensors, reference, dtype, path)
    how = "qtool reader, dequantized in memory" if quantized else "float checkpoint"
    tokenizer = (
        own_tokenizer(found.directory, reference.model.config)
        if found.directory is not None
        else None
    )
    return QuantModel(model, how, tokenizer)


def into_float_architecture(
    tensors: dict[str, torch.Tensor], reference: FloatModel, dtype: torch.dtype, path: Path
) -> Any:
    """FLOAT's architecture holding `tensors` (FLOAT's checkpoint names, shapes and float
    kinds, every one of them), loaded by transformers as it loads FLOAT."""
    check_same_tensors(tensors, reference, path)
    config = copy.deepcopy(reference.model.config)
    model, info = hf.from_pretrained(
        type(reference.model), path, "QUANT", config=config, state_dict=tensors, dtype=dtype
    )
    problem = loading_problem(info, reference.unexpected)
    if problem:
        raise InputError(path, f"QUANT {problem}")
    return model.eval()


def check_same_tensors(tensors: dict[str, torch.Tensor], reference: FloatModel, path: Path) -> None:
    """QUANT holds exactly FLOAT's tensors: the same names, shapes, and float where FLOAT's is."""
    want = reference.checkpoint.tensors
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        parts = [f"lacks {listed(missing)}"] if missing else []
        parts += [f"has {listed(extra)} that FLOAT has not"] if extra else []
        raise InputError(path, f"not a checkpoint of FLOAT's model: it {'; '.join(parts)}")
    for name, (shape, stored) in want.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise InputError(
                path, f"not a checkpoint of FLOAT's model: shape {list(t.shape)} where FLOAT's "
                f"is {list(shape)}", name,
            )  # fmt: skip
        if (stored in FLOAT_DTYPES) != t.is_floating_point():
            raise InputError(
                path, f"holds {t.dtype} values where FLOAT holds {stored} ones (codes without "
                "their qparams?); give the quantized file with its sidecar", name,
            )  # fmt: skip


# ---- checks shared by the loaders ---------------------------------------------------------


def check_same_architecture(reference: FloatModel, found: Detected) -> Any:
    """QUANT's config.json (as detect read it) describes FLOAT's architecture (as transformers
    reads both), but for its quantization_config, dtypes, token ids and bookkeeping; returns
    transformers' config of it."""
    assert found.directory is not None
    path = found.directory
    doc = found.config
    if not isinstance(doc, dict):
        raise InputError(path / "config.json", "not a valid config.json: expected a JSON object")
    theirs = hf.config_from(doc, path, "QUANT")
    ours, other = reference.model.config.to_dict(), theirs.to_dict()
    keys = sorted((set(ours) | set(other)) - CONFIG_NOISE)
    differ = [k for k in keys if ours.get(k) != other.get(k)]
    if differ:
        shown = [f"{k} ({other.get(k)!r}, FLOAT: {ours.get(k)!r})" for k in differ[:3]]
        raise InputError(
            path, f"not FLOAT's architecture: its config.json differs in {', '.join(shown)}"
            f"{f' and {len(differ) - 3} more' if len(differ) > 3 else ''}",
        )  # fmt: skip
    return theirs


def own_tokenizer(path: Path, config: Any) -> hf.Tokenizer | None:
    """QUANT's tokenizer when its directory holds one (compared with FLOAT's on the text)."""
    if not hf.has_tokenizer(path):
        return None
    return hf.tokenizer(path, "QUANT", config)


LOADERS: tuple[QuantLoader, ...] = (
    QuantLoader(_is_ct, _load_ct),
    QuantLoader(lambda found: True, _load_tensors),  # whatever qtool's readers take
)
