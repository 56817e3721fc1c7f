"""Issue 18 item 1: every Linear the model will have is quantized or in `ignore`, including those
the checkpoint holds no weight for (a tied output head). qtool's rules (no transformers) and the
module list transformers builds on the meta device, checked against each other; refusals name
config.json. tests/interop/test_interop_archs.py loads such exports with transformers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from qtool.errors import InputError
from qtool.formats.compressed_tensors import modules
from qtool.formats.compressed_tensors import selection as ct
from qtool.formats.compressed_tensors.modules import Linears, Undecided, by_rules, model_linears
from qtool.io.stformat import TensorEntry

CONFIG = Path("/models/m/config.json")


def entry(name: str, shape: tuple[int, ...] = (64, 64)) -> TensorEntry:
    return TensorEntry(name, "BF16", shape, 0, 0)


LLAMA_BODY = [
    entry("model.embed_tokens.weight", (128, 64)),
    *(
        entry(f"model.layers.{i}.{m}.weight")
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")
    ),
    entry("model.norm.weight", (64,)),
]
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
TIED = {**TINY_LLAMA, "tie_word_embeddings": True}
BODY_MODULES = [e.name.removesuffix(".weight") for e in LLAMA_BODY if len(e.shape) == 2]


def rules(config: dict[str, object], names: list[str]) -> Linears:
    return by_rules(config, CONFIG, frozenset(names), "transformers is not installed")


# ---------------------------------------------------------------- the rules (no transformers)


@pytest.mark.parametrize(
    ("config", "names", "absent"),
    [
        (TIED, ["model.layers.0.mlp.down_proj"], ("lm_head",)),
        ({**TINY_LLAMA, "tie_word_embeddings": None}, ["x.q_proj"], ("lm_head",)),  # unknown
        ({**TINY_LLAMA, "tie_word_embeddings": False}, ["x.q_proj"], ()),
        (TIED, ["x.q_proj", "lm_head"], ()),  # the checkpoint holds its head
        ({"architectures": ["BertModel"], "model_type": "bert"}, ["x.query"], ()),
        ({"architectures": ["Qwen2ForSequenceClassification"]}, ["score"], ()),
        ({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}, ["x"],
         ("embed_out",)),
        ({"architectures": ["BertForMaskedLM"], "model_type": "bert"}, ["x"],
         ("cls.predictions.decoder",)),
        ({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5"}, ["x"],
         ("lm_head",)),
        ({"text_config": {"tie_word_embeddings": False}, "architectures": ["X"]}, ["x"], ()),
    ],
    ids=["tied-llama", "tie-unknown", "untied", "head-present", "bert-base", "classifier",
         "gpt-neox", "bert-mlm", "t5", "vlm-untied"],
)  # fmt: skip
def test_the_rules_name_the_linears_a_checkpoint_lacks(
    config: dict[str, object], names: list[str], absent: tuple[str, ...]
) -> None:
    found = rules(config, names)
    assert found.names is None and found.absent == absent and found.note == ""


@pytest.mark.parametrize(
    ("config", "what"),
    [
        ({"model_type": "llama"}, "config.json names no architectures"),
        ({"architectures": "LlamaForCausalLM"}, "config.json names no architectures"),
        ({"architectures": ["MyRemoteCodeThing"]}, "do not know the output head of MyRemote"),
        ({"architectures": ["ElectraForMaskedLM"], "model_type": "electra"}, "ElectraForMaskedLM"),
    ],
    ids=["no-architectures", "not-a-list", "unknown-class", "unknown-head"],
)
def test_the_rules_refuse_what_they_cannot_decide_naming_config_json(
    config: dict[str, object], what: str
) -> None:
    with pytest.raises(InputError, match="cannot tell which Linear layers") as err:
        rules(config, ["x.q_proj"])
    assert err.value.path == str(CONFIG) and what in str(err.value)
    assert "transformers is not installed" in str(err.value)
    assert "tie_word_embeddings" in str(err.value)  # what the user can do


def test_the_rules_note_why_they_decided_when_transformers_could_not() -> None:
    found = by_rules(TIED, CONFIG, frozenset({"x"}), "transformers 5 has no model class X")
    assert found.absent == ("lm_head",) and found.note == "transformers 5 has no model class X"


def test_a_tied_head_the_checkpoint_lacks_goes_into_ignore() -> None:
    found = rules(TIED, ["model.layers.0.mlp.down_proj"])
    sel = [ct.Selection(e, e.name.removesuffix(".weight"), None) for e in LLAMA_BODY[1:2]]
    assert ct.ignore_list(sel, found.absent) == ["lm_head", "model.layers.0.self_attn.q_proj"]


# ---------------------------------------------------------------- transformers on the meta device


@pytest.fixture
def transformers() -> object:
    return pytest.importorskip("transformers", reason="needs the interop extra")


@pytest.mark.usefixtures("transformers")
def test_transformers_lists_every_linear_and_the_tied_head_it_lacks() -> None:
    found = model_linears(TIED, CONFIG, LLAMA_BODY)
    assert found.how == "transformers LlamaForCausalLM" and found.note == ""
    assert "lm_head" in found.absent and found.is_linear("lm_head")
    assert found.is_linear("model.layers.1.mlp.down_proj")
    assert not found.is_linear("model.embed_tokens")
    # the layers this checkpoint lacks too (k/v/gate/up): every one is ignored, never left out
    assert "model.layers.0.self_attn.k_proj" in found.absent


@pytest.mark.usefixtures("transformers")
def test_a_weight_of_no_linear_is_never_quantized_and_a_linear_never_left_out() -> None:
    """The module list corrects the name rules both ways."""
    found = model_linears(TIED, CONFIG, [*LLAMA_BODY, entry("model.extra_proj.weight")])
    kind = ct.classify(entry("model.extra_proj.weight"), TIED, found)
    assert kind.module is None and kind.fixed
    assert (
        kind.reason == "not an nn.Linear in transformers LlamaForCausalLM (no module of this name)"
    )
    embed = ct.classify(entry("model.embed_tokens.weight", (128, 64)), TIED, found)
    assert embed.module is None and embed.reason == "embedding"  # an nn.Embedding: not listed
    fake = Linears(frozenset({"model.embed_tokens"}), how="transformers X")
    as_linear = ct.classify(entry("model.embed_tokens.weight", (128, 64)), TIED, fake)
    assert as_linear.module == "model.embed_tokens" and as_linear.reason == "embedding"


@pytest.mark.usefixtures("transformers")
def test_gpt2_conv1d_weights_are_what_transformers_builds() -> None:
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 1,
              "n_embd": 16, "n_head": 2, "vocab_size": 32, "n_positions": 8}  # fmt: skip
    names = ["transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc", "transformer.wte"]
    found = model_linears(config, CONFIG, [entry(f"{n}.weight", (16, 48)) for n in names])
    assert found.absent == ("lm_head",)  # GPT-2 ties its head: no weight, still a Linear
    kind = ct.classify(entry("transformer.h.0.mlp.c_fc.weight", (16, 48)), config, found)
    assert kind.module is None and "Conv1D" in kind.reason


@pytest.mark.usefixtures("transformers")
@pytest.mark.parametrize(
    ("config", "note", "absent"),
    [
        ({**TIED, "architectures": ["NoSuchModelForCausalLM"]}, "has no model class NoSuch",
         ("lm_head",)),
        ({**TIED, "architectures": ["AutoModelForCausalLM"]}, "has no model class AutoModel",
         ("lm_head",)),
        ({**TIED, "architectures": ["PreTrainedModel"]}, "names of PreTrainedModel do not", ()),
        ({**TIED, "hidden_size": -5}, "could not build LlamaForCausalLM", ("lm_head",)),
    ],
    ids=["unknown-class", "not-a-model-class", "abstract-class", "bad-size"],
)  # fmt: skip
def test_what_transformers_cannot_build_falls_back_to_the_rules_quickly(
    config: dict[str, object], note: str, absent: tuple[str, ...]
) -> None:
    started = time.monotonic()
    found = model_linears(config, CONFIG, LLAMA_BODY)
    assert time.monotonic() - started < 60  # never builds a billion layers
    assert found.names is None and found.absent == absent and note in found.note


@pytest.mark.usefixtures("transformers")
def test_a_class_name_that_is_no_class_is_never_built_and_refused_by_the_rules() -> None:
    with pytest.raises(InputError, match="has no model class __loader__"):
        model_linears({**TIED, "architectures": ["__loader__"]}, CONFIG, LLAMA_BODY)


@pytest.mark.usefixtures("transformers")
def test_names_that_match_nothing_transformers_builds_fall_back_to_the_rules() -> None:
    """A checkpoint saved from another class (no `model.` prefix): transformers' module names
    would not say which of its tensors are Linears."""
    entries = [entry(e.name.removeprefix("model."), e.shape) for e in LLAMA_BODY]
    found = model_linears(TIED, CONFIG, entries)
    assert found.names is None and "do not match the checkpoint" in found.note


def test_without_transformers_the_rules_decide_silently(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> object:
        raise ImportError(name)

    monkeypatch.setattr(modules.importlib, "import_module", missing)
    found = model_linears(TIED, CONFIG, LLAMA_BODY)
    assert found == Linears(None, ("lm_head",), note="")
    with pytest.raises(InputError, match="config.json names no architectures"):
        model_linears({"model_type": "llama"}, CONFIG, LLAMA_BODY)


def test_undecided_is_what_the_rules_hear() -> None:
    assert issubclass(Undecided, Exception) and not issubclass(Undecided, InputError)


# ---------------------------------------------------------------- the answer kept in the user cache


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The arguments of every call of built_linears from here on (it still builds)."""
    calls: list[object] = []
    real = modules.built_linears
    monkeypatch.setattr(modules, "built_linears", lambda *a: calls.append(a) or real(*a))
    return calls


def _no_build(*_: object) -> Linears:
    raise AssertionError("built again: the cached answer was not used")


@pytest.mark.usefixtures("transformers")
def test_the_second_export_of_a_model_takes_the_cached_answer(
    monkeypatch: pytest.MonkeyPatch, private_cache: Path
) -> None:
    first = model_linears(TIED, CONFIG, LLAMA_BODY)
    assert len(list(private_cache.glob("linears-*.json"))) == 1
    monkeypatch.setattr(modules, "built_linears", _no_build)
    assert model_linears(TIED, CONFIG, LLAMA_BODY) == first


@pytest.mark.usefixtures("transformers")
@pytest.mark.parametrize(
    "change",
    [
        lambda c, e: ({**c, "num_hidden_layers": 3}, e),
        lambda c, e: (c, e[:-2]),
        lambda c, e: (c, [*e, entry("model.extra_proj.weight")]),
    ],
    ids=["config", "fewer-weights", "more-weights"],
)
def test_another_config_or_checkpoint_is_never_answered_from_the_cache(
    builds: list[object], change: object
) -> None:
    model_linears(TIED, CONFIG, LLAMA_BODY)
    builds.clear()
    config, entries = change(TIED, LLAMA_BODY)  # type: ignore[operator]
    model_linears(config, CONFIG, entries)
    assert len(builds) == 1


@pytest.mark.usefixtures("transformers")
def test_what_transformers_could_not_build_is_never_cached(private_cache: Path) -> None:
    """Why it could not build (a missing dependency of the model's code) may be mended."""
    config = {**TIED, "architectures": ["NoSuchModelForCausalLM"]}
    assert "no model class" in model_linears(config, CONFIG, LLAMA_BODY).note
    assert not list(private_cache.iterdir())


@pytest.mark.usefixtures("transformers")
@pytest.mark.parametrize("edited", ["modeling_llama.py", "modeling_utils.py", "__init__.py"])
def test_a_transformers_edited_in_place_is_asked_again(
    monkeypatch: pytest.MonkeyPatch, builds: list[object], edited: str
) -> None:
    """Same version, same place, other code (a git checkout, an editable install): any source
    file the build imported, not only the model's own."""
    model_linears(TIED, CONFIG, LLAMA_BODY)
    builds.clear()
    real_stamp = modules._stamp
    monkeypatch.setattr(
        modules, "_stamp", lambda path: [0, 0] if path.name == edited else real_stamp(path)
    )
    model_linears(TIED, CONFIG, LLAMA_BODY)
    model_linears(TIED, CONFIG, LLAMA_BODY)
    assert len(builds) == 1  # asked again once, then cached with the new stamps


def test_a_missing_transformers_is_never_cached(
    monkeypatch: pytest.MonkeyPatch, private_cache: Path
) -> None:
    real = modules.importlib.util.find_spec
    monkeypatch.setattr(
        modules.importlib.util,
        "find_spec",
        lambda n, *a: None if n == "transformers" else real(n, *a),
    )
    assert model_linears(TIED, CONFIG, LLAMA_BODY) == Linears(None, ("lm_head",), note="")
    assert not list(private_cache.iterdir())


@pytest.mark.usefixtures("transformers")
def test_a_transformers_without_package_metadata_still_builds_but_is_not_cached(
    monkeypatch: pytest.MonkeyPatch, private_cache: Path
) -> None:
    """A source checkout on PYTHONPATH: no RECORD to tell one install from another."""
    monkeypatch.setattr(modules, "_install_identity", lambda origin: None)
    found = model_linears(TIED, CONFIG, LLAMA_BODY)
    assert found.how == "transformers LlamaForCausalLM" and "lm_head" in found.absent
    assert not list(private_cache.iterdir())


@pytest.mark.usefixtures("transformers")
@pytest.mark.parametrize(
    "value",
    [
        {"names": ["lm_head"], "absent": [], "classes": {}, "how": 1},
        {"names": "lm_head", "absent": [], "classes": {}, "how": "t"},
        {"names": [], "absent": [], "classes": {"a": 1}, "how": "t"},
        {"undecided": "planted"},
        # shaped right, but at odds with these weights
        {"names": ["x"], "absent": ["x"], "classes": {}, "how": "t"},
        {"names": [*BODY_MODULES, "lm_head"], "absent": [], "classes": {}, "how": "t"},
    ],
    ids=["how", "names", "classes", "undecided", "foreign-names", "absent-dropped"],
)  # fmt: skip
def test_a_cache_entry_of_any_other_shape_is_a_miss(private_cache: Path, value: dict) -> None:
    truth = model_linears(TIED, CONFIG, LLAMA_BODY)
    (entry_file,) = private_cache.glob("linears-*.json")
    files = json.loads(entry_file.read_text())["value"]["files"]  # stamps that still hold
    planted = {"key": entry_file.stem, "value": {**value, "files": files}}
    entry_file.write_text(json.dumps(planted, separators=(",", ":")))
    assert model_linears(TIED, CONFIG, LLAMA_BODY) == truth


@pytest.mark.usefixtures("transformers")
def test_a_planted_entry_with_current_stamps_is_taken(private_cache: Path) -> None:
    """The counterpart of the misses above: the planted entries differ only where they say."""
    model_linears(TIED, CONFIG, LLAMA_BODY)
    (entry_file,) = private_cache.glob("linears-*.json")
    doc = json.loads(entry_file.read_text())
    doc["value"]["how"] = "planted"
    entry_file.write_text(json.dumps(doc, separators=(",", ":")))
    assert model_linears(TIED, CONFIG, LLAMA_BODY).how == "planted"
