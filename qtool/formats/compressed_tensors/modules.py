"""Which nn.Linear modules the model has: what a consumer builds from config.json, so that an
export quantizes or names in `ignore` every one, including those the checkpoint holds no weight
for (an output head tied to the input embeddings: `lm_head` of SmolLM2, Llama 3.2, Qwen2.5).

With transformers installed, the class config.json's `architectures` names is built on the meta
device (no memory, no weights, no code from the model directory) as `from_pretrained` builds it,
and its nn.Linear modules are listed. Without transformers, or when it cannot build that class,
rules decide (`by_rules`): an output head with no weight in the checkpoint is the only Linear a
checkpoint can lack. When neither can decide, InputError naming config.json and what is unknown.

Building the class costs seconds (importing transformers' modeling code: 4.6 s on a quiet
machine, half of a first SmolLM2 export), and its answer depends only on transformers' code,
the config and the checkpoint's weight names: it is kept in the user's cache
(io/usercache.py), so only the first export of a model pays it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from qtool.errors import InputError
from qtool.formats.model_config import check_counts, check_layer_indices, untied
from qtool.io import usercache
from qtool.io.stformat import TensorEntry

OUTPUT_HEADS = frozenset({"lm_head", "embed_out"})
"""Output heads by name alone."""
TIED_HEADS = frozenset({"lm_head", "embed_out", "decoder", "output", "proj_out", "vocab_projector"})
"""Output heads when their rows are the vocabulary (`cls.predictions.decoder`, ...)."""

NO_HEAD_SUFFIXES = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
    "ForImageClassification",
    "ForAudioClassification",
    "ForAudioFrameClassification",
    "ForXVector",
    "ForCTC",
    "ForNextSentencePrediction",
    "ForDepthEstimation",
    "Model",
    "Encoder",
)
"""Classes without output embeddings: nothing can be tied, every Linear has its own weight."""
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
"""Classes whose output head is `lm_head` unless HEADS says otherwise."""
HEAD_SUFFIXES = (*CAUSAL_SUFFIXES, "ForMaskedLM", "ForPreTraining", "WithLMHeadModel")
HEADS = {
    "gpt_neox": "embed_out",
    "whisper": "proj_out",
    "bert": "cls.predictions.decoder",
    "roberta": "lm_head.decoder",
    "xlm-roberta": "lm_head.decoder",
    "camembert": "lm_head.decoder",
    "distilbert": "vocab_projector",
}
"""Output heads that are not `lm_head`, by model_type."""


@dataclass(frozen=True)
class Linears:
    """The model's nn.Linear modules: `names` all of them (None: not known, the rules decided
    from the checkpoint's tensor names), `absent` those the checkpoint holds no weight for,
    `classes` the class of every other module that owns a weight (for messages), `how` who
    decided ("transformers LlamaForCausalLM", "rules"), `note` why the rules did."""

    names: frozenset[str] | None
    absent: tuple[str, ...] = ()
    classes: Mapping[str, str] | None = None
    how: str = "rules"
    note: str = ""

    def is_linear(self, module: str) -> bool | None:
        """Whether the built model has `module` as an nn.Linear (None: not known)."""
        return None if self.names is None else module in self.names

    def class_of(self, module: str) -> str:
        return (self.classes or {}).get(module, "no module of this name")


class Undecided(Exception):
    """Why transformers did not list the model's Linear modules (the rules decide then)."""


def model_linears(
    config: Mapping[str, object], path: Path | None, entries: Sequence[TensorEntry]
) -> Linears:
    """The Linear modules of the model config.json describes (`path` names it in messages),
    given the checkpoint's tensors; InputError when neither transformers nor the rules decide,
    or when config.json's layer and expert counts ask for more modules than the checkpoint
    backs (model_config.check_counts: nothing is built then)."""
    check_counts(config, path, {e.name: e.shape for e in entries})
    check_layer_indices(config, path, [e.name for e in entries])
    weights = matrix_modules(entries)
    try:
        return cached_linears(config, weights, len(entries))
    except Undecided as why:
        return by_rules(config, path, weights, str(why))


def matrix_modules(entries: Sequence[TensorEntry]) -> frozenset[str]:
    """Modules whose `.weight` is a 2-D tensor of the checkpoint."""
    return frozenset(
        e.name[: -len(".weight")]
        for e in entries
        if e.name.endswith(".weight") and len(e.shape) == 2
    )


# ---------------------------------------------------------------- transformers' answer, kept


def cached_linears(config: Mapping[str, object], weights: frozenset[str], count: int) -> Linears:
    """built_linears, through the user's cache (only what transformers built is kept: why it
    could not build may be mended by an install). An entry holds the stamp of every
    transformers source file the build imported, and is used only while they are unchanged (a
    git checkout or editable install changes code under the same version)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        raise Undecided("transformers is not installed")
    identity = _install_identity(spec.origin)
    if identity is None:  # transformers without package metadata: asked every time
        return built_linears(config, weights, count)
    key = usercache.key_of("linears", identity, dict(config), sorted(weights), count)
    doc = usercache.load(key)
    cached = _from_doc(doc, weights) if doc is not None and _unchanged(doc.get("files")) else None
    if cached is not None:
        return cached
    found = built_linears(config, weights, count)
    usercache.store(key, {**_to_doc(found), "files": _transformers_files()})
    return found


def _install_identity(origin: str) -> list[str] | None:
    """What the answer depends on besides the model, found without importing transformers
    (`origin`: its __init__.py): the version, place and file list hash of the transformers
    install (pip's RECORD holds every file's hash), torch's version, and this module's own
    source (its rules and the shape of an entry); None when transformers has no metadata."""
    try:
        dist = importlib.metadata.distribution("transformers")
        record = dist.read_text("RECORD") or ""
        torch_version = importlib.metadata.version("torch")
        source = Path(__file__).read_bytes()
    except (ValueError, OSError, importlib.metadata.PackageNotFoundError):
        return None
    return [
        dist.version,
        origin,
        hashlib.sha256(record.encode()).hexdigest(),
        torch_version,
        hashlib.sha256(source).hexdigest(),
    ]


def _transformers_files() -> dict[str, list[int]]:
    """The stamp (size, mtime) of every transformers source file this process imported."""
    files = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if (name == "transformers" or name.startswith("transformers.")) and isinstance(path, str):
            files[path] = _stamp(Path(path))
    return files


def _unchanged(files: object) -> bool:
    """Whether every file of an entry's stamps is still as it was."""
    if not (isinstance(files, dict) and files):
        return False
    return all(isinstance(p, str) and _stamp(Path(p)) == stamp for p, stamp in files.items())


def _stamp(path: Path) -> list[int]:
    try:
        st = path.stat()
    except OSError:
        return []
    return [st.st_size, st.st_mtime_ns]


def _to_doc(found: Linears) -> dict[str, object]:
    return {
        "names": sorted(found.names or ()),
        "absent": list(found.absent),
        "classes": dict(found.classes or {}),
        "how": found.how,
    }


def _from_doc(doc: Mapping[str, object], weights: frozenset[str]) -> Linears | None:
    """A cached answer, or None when the document is not of the shape _to_doc writes or is at
    odds with these weights (a corrupt entry): none of them a Linear, or `absent` not the
    Linears without one."""
    names, absent, classes, how = (doc.get(k) for k in ("names", "absent", "classes", "how"))
    if not (_strings(names) and _strings(absent) and isinstance(how, str)):
        return None
    if not (isinstance(classes, dict) and _strings([*classes, *classes.values()])):
        return None
    listed = frozenset(names)
    if (weights and not weights & listed) or absent != sorted(listed - weights):
        return None
    return Linears(listed, tuple(absent), classes, how)


def _strings(value: object) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


# ---------------------------------------------------------------- transformers


def built_linears(config: Mapping[str, object], weights: frozenset[str], count: int) -> Linears:
    """The Linears of the class config.json names, built on the meta device; Undecided when
    transformers is missing or cannot build it, or its names do not match the checkpoint's."""
    arch, model_type = _architecture(config)
    try:
        transformers = importlib.import_module("transformers")
        torch = importlib.import_module("torch")
    except ImportError:
        raise Undecided("transformers is not installed") from None
    cls = _model_class(transformers, arch)
    with _quiet(transformers):
        try:
            dropped = ("quantization_config", "model_type")
            fields = {k: v for k, v in config.items() if k not in dropped}
            built = transformers.AutoConfig.for_model(model_type, **fields)
            with torch.device("meta"):
                model = cls(built)
        except Exception as err:  # any failure of a third-party build: the rules decide
            raise Undecided(f"transformers could not build {arch}: {_first_line(err)}") from None
    return _listed(model, torch.nn.Linear, arch, weights)


def _model_class(transformers: Any, arch: str) -> Any:
    """transformers' model class named `arch` (only a PreTrainedModel; no remote code)."""
    cls = getattr(transformers, arch, None)
    base = getattr(transformers, "PreTrainedModel", None)
    if not (isinstance(cls, type) and isinstance(base, type) and issubclass(cls, base)):
        version = getattr(transformers, "__version__", "?")
        raise Undecided(f"transformers {version} has no model class {arch}")
    return cls


def _architecture(config: Mapping[str, object]) -> tuple[str, str]:
    archs, model_type = config.get("architectures"), config.get("model_type")
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        raise Undecided("config.json names no architectures")
    if not isinstance(model_type, str):
        raise Undecided("config.json has no model_type")
    return archs[0], model_type


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """transformers' logging and Python warnings silenced while it builds the model."""
    logging = transformers.logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(level)


def _listed(model: Any, linear: type, arch: str, weights: frozenset[str]) -> Linears:
    names, classes = set(), {}
    for name, module in model.named_modules():
        if isinstance(module, linear):
            names.add(name)
        elif "weight" in getattr(module, "_parameters", {}):
            classes[name] = type(module).__name__
    if weights and not weights & names:
        raise Undecided(f"the module names of {arch} do not match the checkpoint's tensor names")
    absent = tuple(sorted(names - weights))
    return Linears(frozenset(names), absent, classes, f"transformers {arch}")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


# ---------------------------------------------------------------- rules


def by_rules(
    config: Mapping[str, object], path: Path | None, weights: frozenset[str], why: str
) -> Linears:
    """Without transformers: the checkpoint's Linears are those its tensor names show; the only
    one it can lack is an output head tied to the input embeddings. None is missing when
    config.json unties the embeddings, when the checkpoint holds the head, or when the class has
    no output head; otherwise the head is named by the class and model_type (HEADS), and
    InputError when they do not say."""
    note = "" if why == "transformers is not installed" else why
    if untied(config) or any(_is_head(m) for m in weights):
        return Linears(None, note=note)
    archs = config.get("architectures")
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
        raise _undecidable(path, "config.json names no architectures", why)
    arch, model_type = archs[0], config.get("model_type")
    head = _head_of(arch, model_type if isinstance(model_type, str) else None)
    if head is None:
        return Linears(None, note=note)
    if head == "":
        raise _undecidable(path, f"qtool's rules do not know the output head of {arch}", why)
    return Linears(None, (head,), note=note)


def _is_head(module: str) -> bool:
    leaf = module.rpartition(".")[2]
    return leaf in OUTPUT_HEADS or module in HEADS.values()


def _head_of(arch: str, model_type: str | None) -> str | None:
    """The output head of `arch` (None: it has none; "": not known)."""
    if arch.endswith(HEAD_SUFFIXES):
        if model_type in HEADS:
            return HEADS[model_type]
        return "lm_head" if arch.endswith(CAUSAL_SUFFIXES) else ""
    return None if arch.endswith(NO_HEAD_SUFFIXES) else ""


def _undecidable(path: Path | None, what: str, why: str) -> InputError:
    reasons = what if why == what else f"{what}; {why}"
    return InputError(
        path,
        f"cannot tell which Linear layers the model has ({reasons}), and a "
        "compressed-tensors export must quantize or ignore every one, an output head tied to "
        "the input embeddings included; install transformers (the interop extra) so qtool "
        'builds the model from config.json, or set "tie_word_embeddings": false there if '
        "the model ties no weights",
    )
