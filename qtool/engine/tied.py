"""Which input embedding is also the model's output head (tied word embeddings), from the tensor
names and config.json alone (torch-free).

A tied embedding is the one tensor both ends of the model read: 4-bit codes there cost more than
anywhere else (SmolLM2-135M, int4 group 64: perplexity x2.07 with it quantized, x1.45 with it
float). qtool's compressed-tensors export never quantizes an embedding: compressed-tensors 0.20
can describe and decompress one, but transformers 5.23 and vLLM cannot load it
(tests/interop/test_ct_quantized_embedding.py). The qtool format keeps a tied one float at 4
bits by default (engine/plan.py), and a run that quantizes one to 4 bits anyway warns.

The rules are those transformers loads by: no output head tensor in the checkpoint (`lm_head`,
`embed_out`, `output`), `tie_word_embeddings` not false (transformers' default is true), and a
class with an output head (`architectures[0]` ends in ForCausalLM, LMHeadModel, ...). Without
a config.json only a decoder's embedding names count (`embed_tokens`, `wte`, `tok_embeddings`,
`embed_in`): an encoder's `word_embeddings` has no head to be tied to.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from qtool.formats.model_config import untied

_HEADS = ("lm_head", "embed_out", "output")
_HEAD_CLASSES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForMaskedLM",
                 "ForPreTraining", "WithLMHeadModel")  # fmt: skip
_DECODER_EMBEDDINGS = ("embed_tokens", "wte", "tok_embeddings", "embed_in")
_EMBEDDINGS = (*_DECODER_EMBEDDINGS, "word_embeddings")


def tied_embeddings(names: Iterable[str], config: object) -> frozenset[str]:
    """The names of the input embeddings that are also the output head (see the module
    docstring); `config`: config.json parsed (None: there is none)."""
    names = list(names)
    modules = [n[: -len(".weight")] for n in names if n.endswith(".weight")]
    if any(m.rpartition(".")[2] in _HEADS for m in modules):
        return frozenset()
    leaves: tuple[str, ...] = _DECODER_EMBEDDINGS
    if isinstance(config, Mapping):
        if untied(config) or not _has_head(config):
            return frozenset()
        leaves = _EMBEDDINGS
    return frozenset(f"{m}.weight" for m in modules if m.rpartition(".")[2] in leaves)


def embedding_or_head(name: str) -> bool:
    """An input embedding or an output head, by its module's last name (checkpoint or GGUF)."""
    leaf = name.removesuffix(".weight").rpartition(".")[2]
    return leaf in (*_EMBEDDINGS, *_HEADS, "token_embd")


def _has_head(config: Mapping[str, object]) -> bool:
    """The class transformers builds has an output head (no `architectures`: assume it has)."""
    archs = config.get("architectures")
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
        return True
    return archs[0].endswith(_HEAD_CLASSES)
