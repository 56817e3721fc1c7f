"""The tokenizer of a Hugging Face model directory as llama.cpp's converter writes it into a GGUF
(convert_hf_to_gguf.py of llama-cpp-python 0.3.36's vendored llama.cpp), by its two paths:

- a tokenizer.model (SentencePiece: Llama 2, Mistral 7B v0.1, TinyLlama): _set_vocab_sentencepiece,
  model "llama", each piece's text, score and type read by sp_model (no sentencepiece package),
  added tokens from added_tokens.json then tokenizer_config.json's added_tokens_decoder;
- else tokenizer.json, byte-level BPE only (model BPE with a ByteLevel decoder: SmolLM2, Llama 3,
  Qwen2, Mistral's tekken-era tokenizers): _set_vocab_gpt2, model "gpt2" with merges. A BPE
  tokenizer.json with byte fallback and no tokenizer.model (the converter's LlamaHfVocab) is
  refused.

    keys = vocab_metadata(directory, vocab_size, writer)   # adds tokenizer.* to a gguf.GGUFWriter

tokens, token_type: every id below the config's vocab_size (ids no token has are [PADn],
UNUSED), added tokens CONTROL when special or when they look special, else USER_DEFINED;
merges, special token ids, add_bos/add_eos and the chat template: gguf-py's SpecialVocab, as the
converter takes them. tokenizer.ggml.pre: the converter hashes the tokenizer's ids for a fixed
text and looks the hash up (get_vocab_base_pre); PRE_TOKENIZERS is its table.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from hashlib import sha256
from pathlib import Path
from typing import Any

from qtool.errors import InputError, UsageError
from qtool.formats.gguf import sp_model
from qtool.formats.gguf.sp_model import read_pieces
from qtool.io.jsonfile import read_json_object
from qtool.io.safeopen import file_kind, read_bounded

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5  # gguf.TokenType
PAD_SCORE, ADDED_SCORE = -10000.0, -1000.0  # _create_vocab_sentencepiece's scores
CONVERTER = "convert it with llama.cpp's convert_hf_to_gguf.py"
INSTALL_TOKENIZERS = "pip install tokenizers"

# get_vocab_base_pre's fixed text: the hash of its ids names the pre-tokenizer
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple "
    "emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333"
    " 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天"
    "～ ------======= нещо на Български ''''''```````\"\"\"\"......!!!"
    "!!!?????? I've been 'told he's there, 'RE you sure? 'M not s"
    "ure I'll make it, 'D you like some tea? We'Ve a'lL"
)

PRE_TOKENIZERS: dict[str, str] = {
    "b6e8e1518dc4305be2fe39c313ed643381c4da5db34a98f6a04c093f8afbe99b": "chatglm-bpe",
    "81d72c7348a9f0ebe86f23298d37debe0a5e71149e29bd283904c02262b27516": "chatglm-bpe",
    "a1336059768a55c99a734006ffb02203cd450fed003e9a71886c88acf24fdbc2": "glm4",
    "9ca2dd618e8afaf09731a7cf6e2105b373ba6a1821559f258b272fe83e6eb902": "glm4",
    "cdf5f35325780597efd76153d4d1c16778f766173908894c04afc20108536267": "glm4",
    "1431a23e583c97432bc230bff598d103ddb5a1f89960c8f1d1051aaa944d0b35": "minerva-7b",
    "7e57df22b1fe23a7b1e1c7f3dc4e3f96d43a4eb0836d0c6bdc3436d7b2f1c664": "hunyuan",
    "bba3b3366b646dbdded5dbc42d59598b849371afc42f7beafa914afaa5b70aa6": "hunyuan-dense",
    "e6ddf9c6686791c12d698d34c31ab9be1fea9af5a3d9a6909783ab382198ae1c": "hy_v4",
    "a6b57017d60e6edb4d88ecc2845188e0eb333a70357e45dcc9b53964a73bbae6": "falcon-h1",
    "60476e1243776c4fb1b993dbd7a5f15ac22f83c80afdf425fa5ae01c8d44ef86": "falcon-h1",
    "3eda48b4c4dc7de733d1a8b3e3b4a85243dbbf704da2ee9d42c6beced8897896": "falcon-h1",
    "48f8e02c0359c0bbdd82f26909171fac1c18a457bb47573ed1fe3bbb2c1cfd4b": "falcon-h1",
    "81212dc7cdb7e0c1074ca62c5aeab0d43c9f52b8a737be7b12a777c953027890": "kimi-k2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": "qwen35",
    "66b8d4e19ab16c3bfd89bce5d785fb7e0155e8648708a1f42077cb9fe002c273": "grok-2",
    "b3d1dd861f1d4c5c0d2569ce36baf3f90fe8a102db3de50dd71ff860d91be3df": "jina-v2-de",
    "0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4": "gpt-2",
    "9e454714343b69b99b71795c1d27a68c2a1d15dab111f4d353109f966af29da7": "lfm2",
    "846deafc5b0fa786186fa4ae6c7b49903cf2f1d1895bdb80b9120d60be135252": "gemma4",
    "0a766d034107bc736a3f2dc4968fd62e54a3570f1454443e0c5a4cc6bd7941ed": "spark2_5",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",
    "8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed": "falcon",
    "0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f": "jina-v2-en",
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",
    "8e62295832751ca1e8f92f2226f403dea30dc5165e448b5bfa05af5340c64ec7": "bert-bge-large",
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "olmo",
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3": "stablelm2",
    "6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff": "refact",
    "9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8": "command-r",
    "d772b220ace2baec124bed8cfafce0ead7d6c38a4b65ef11261cf9d5d62246d1": "tiny_aya",
    "52df12b4c8d4176e7481aab4b6e8454d1fd0a210a04a574f6d4e067d10e23c3e": "cohere2moe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e": "dbrx",
    "c7699093ba4255a91e702aa38a596aa81669f3525dae06c2953267dde580f448": "jina-v1-en",
    "171aeeedd6fb548d418a7461d053f11b6f1f1fc9b387bd66640d28a4b9f5c643": "jina-v2-es",
    "27949a2493fc4a9f53f5b9b029c82689cfbe5d3a1929bb25e043089e28466de6": "jina-v2-de",
    "a023e9fdc5a11f034d3ef515b92350e56fb2af1f66c6b6811a4444ea9bf8763d": "jina-v5-nano",
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",
    "c7ea5862a53e4272c035c8238367063e2b270d51faa48c0f09e9d5b54746c360": "poro-chat",
    "7967bfa498ade6b757b064f31e964dddbb80f8f9a4d68d4ba7998fcf281c531a": "jina-v2-code",
    "7fc505bd3104ca1083b150b17d088b59534ede9bde81f0dd2090967d7fe52cee": "viking",
    "b53802fb28e26d645c3a310b34bfe07da813026ec7c7716883404d5e0f8b1901": "jais",
    "bc5108ee1eb6a3d600cadd065f63190fbd0554dbc9e4bbd6a0d977970afc8d2a": "jais-2",
    "7b3e7548e4308f52a76e8229e4e6cc831195d0d1df43aed21ac6c93da05fec5f": "codeshell",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "3c30d3ad1d6b64202cd222813e7736c2db6e1bd6d67197090fc1211fbc612ae7": "bloom",
    "bc01ce58980e1db43859146dc51b1758b3b88729b217a74792e9f8d43e479d21": "gpt3-finnish",
    "4e2b24cc4770243d65a2c9ec19770a72f08cffc161adbb73fcbb6b7dd45a0aae": "exaone",
    "fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085": "phi-2",
    "60824e3c0d9401f89943cbb2fff727f0e2d4c545ba4df2d6e4f09a6db0f5b450": "chameleon",
    "8b5a93ed704057481f240da0be7e7dca721d7f8f4755263b6807227a2cbeae65": "roberta-bpe",
    "ad851be1dba641f2e3711822f816db2c265f788b37c63b4e1aeacb9ee92de8eb": "gigachat",
    "d4c8f286ea6b520b3d495c4455483cfa2302c0cfcd4be05d781b6a8a0a7cdaf1": "megrez",
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",
    "7dec86086fcc38b66b7bc1575a160ae21cf705be7718b9d5598190d7c12db76f": "superbpe",
    "1994ffd01900cfb37395608534236ecd63f2bd5995d6cb1004dda1af50240f15": "trillion",
    "96a5f08be6259352137b512d4157e333e21df7edd3fcd152990608735a65b224": "bailingmoe",
    "d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406": "llama4",
    "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3": "pixtral",
    "d5f1dd6f980fec569fb218a81a7658ac45fc56b38c5a0adeb1c232fbe04ef5ec": "seed-coder",
    "b0a6b1c0bd5998ebd9df08611efde34a4ff03faed45ae09c43e6b31ebd4b94cf": "a.x-4.0",
    "f6791d196f87ce6b56a7d234be618e0d58f8cda3549416635b2bebcd22cd95c4": "midm-2.0",
    "169bf0296a13c4d9b7672313f749eb36501d931022de052aad6e36f2bf34dd51": "lfm2",
    "2085e1638f6c377a0aa4ead21b27bb4cb941bf800df86ed391011769c1758dfb": "exaone4",
    "a1e163ecab2e718a4c829d1148b6e86824ec36163bb71941c3dca9cd5ac25756": "mellum",
    "a0b64b4385f123663873756336c085744376d015ff328bb1d901598f63c44152": "modern-bert",
    "49fc0303c9e0d2c2c565c510f64b2d9b271276acdcdadff733249eda9f7d59df": "afmoe",
    "9b1be57e70d20d9501b2b3186e792d81181ae36ada3903c26f9fea418cf87206": "bailingmoe2",
    "53e325976a6e142379c19b09afcae354f2f496f147afa8f9e189a33fe4e3024e": "granite-docling",
    "f4f37b6c8eb9ea29b3eac6bb8c8487c5ab7885f8d8022e67edc1c68ce8403e95": "minimax-m2",
    "4a2e2abae11ca2b86d570fc5b44be4d5eb5e72cc8f22dd136a94b37da83ab665": "kormo",
    "9d70134b369a70e5735009b6de918f7581b5211f7c074d1f89f753aea8248af1": "youtu",
    "16389f0a1f51ee53e562ffd51c371dc508639ab0e4261502071836e50e223e91": "solar-open",
    "6c81ce329e0802883b22eabab0d3fa48357337ef1ecb45443828bf1f6254833f": "exaone-moe",
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",
    "b4b8ca1f9769494fbd956ebc4c249de6131fb277a4a3345a7a92c7dd7a55808d": "joyai-llm",
    "e4d54df1ebc1f2b91acd986c5b51aa50837d5faf7c7398e73c1f9e9ee5d19869": "kanana2",
    "862f827721df956049dff5ca81a57f29e575280bc622e290d3bf4e35eca29015": "f2llmv2",
    "62f6fb0a6fd5098caeabb19b07a5c1099cafc8b9c40eab6ea89ece4ec02fbc57": "sarvam-moe",
    "f728162c1315c26e40249849799b4ba3fe584c32084b4795b03eb295e63cb5af": "talkie",
    "36f3066e97b7f3994b379aaacde306c1444c6ae84e81a5ae3cd2b7ed3b8c42d4": "minicpm5",
    "f241072145675bf8322086f115aebad05e9f869557a238bf2150a2a417d1bf60": "granite-embed-multi-97m",
    "789696f5946cc0fc59371f39f6097cafed196b3acded6140432f26bbb1ae1669": "granite-embed-multi-311m",
    "9dcf830ee9990cdbf78cc523a5f7bd9ad8f3f9890c2d3581d2785ad10f07049d": "mellum2",
    "972da7b59cec44d1f0a490a86c96df53859e486e481563e5dddac155013d87ac": "laguna",
    "653660222fb704f61cbf2b618a8ae6502b7f8b20c980f9a5de07ed78e13319cd": "ufakzeka",
}
"""sha256 of str(ids of CHECK_TEXT) -> tokenizer.ggml.pre, from get_vocab_base_pre (where a hash
appears twice, the later entry wins, as its chain of ifs does)."""


MAX_TOKENIZER_BYTES = 64_000_000
"""Per tokenizer file, as eval's (engine/model/checked.py): the largest real tokenizer.json
files are a few tens of MB (Gemma 3's 33 MB, Llama 3's 9 MB); each is read whole."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "chat_template.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json")  # fmt: skip


def read_tokenizer(directory: Path) -> dict[str, Any]:
    """tokenizer.json, checked to be a byte-level BPE tokenizer (InputError otherwise); call
    check_files first."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise InputError(directory, "no tokenizer.json or tokenizer.model: qtool writes the "
                         f"vocabulary from one; {CONVERTER}")  # fmt: skip
    data = read_json_object(path, limit=MAX_TOKENIZER_BYTES, what="tokenizer file")
    model, decoder = data.get("model"), data.get("decoder")
    if _llama_hf(model, decoder):
        raise InputError(path, "a SentencePiece BPE tokenizer (byte fallback) without its "
                         "tokenizer.model: llama.cpp's converter writes it with no scores "
                         "(LlamaHfVocab: every score -1000, no merges), and llama.cpp then splits "
                         "text otherwise than the model does; put the model's tokenizer.model "
                         "beside it (qtool and convert_hf_to_gguf.py then write its "
                         "scores)")  # fmt: skip
    if not isinstance(model, dict) or model.get("type") != "BPE" or model.get("byte_fallback"):
        raise InputError(path, "not a byte-level BPE tokenizer (its model is "
                         f"{_kind(model)}); qtool writes those, or SentencePiece ones from "
                         f"their tokenizer.model; {CONVERTER}")  # fmt: skip
    if not _byte_level(decoder):
        raise InputError(path, "a BPE tokenizer without a ByteLevel decoder (a SentencePiece-"
                         "style vocabulary without its tokenizer.model); qtool writes "
                         f"byte-level ones and tokenizer.model ones; {CONVERTER}")  # fmt: skip
    if not isinstance(model.get("vocab"), dict):
        raise InputError(path, "its model has no vocab")
    _check_ids(data, path)
    check_post_processor(data, path)
    return data


def check_files(directory: Path) -> None:
    """Every tokenizer file the conversion reads is a regular file (or absent) of at most
    MAX_TOKENIZER_BYTES, and those gguf-py reads hold what it takes (InputError otherwise)."""
    for name in TOKENIZER_FILES:
        _regular_or_absent(directory / name)
    extra = sorted((directory / "additional_chat_templates").glob("*.jinja"))
    for file in [*(directory / name for name in TOKENIZER_FILES), *extra]:
        # gguf-py and tokenizers read them whole, unbounded
        size = file.stat().st_size if file.is_file() else 0
        if size > MAX_TOKENIZER_BYTES:
            why = f"is {size:,} bytes, over the limit of {MAX_TOKENIZER_BYTES:,} for its kind"
            raise InputError(file, f"{why}; is it intact?")
    for file in extra:
        _regular_or_absent(file)
    _check_side_files(directory, extra)


INFILL = ("prefix", "suffix", "middle", "eot")  # CodeLlama's infill tokens, ids 32007 on
SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask", "eot", "eom")
"""gguf-py SpecialVocab's special_token_types: tokenizer_config.json's X_token, add_X_token."""


def _regular_or_absent(path: Path) -> None:
    """A tokenizer file is a regular file (or a link to one) or absent: gguf-py skips one that
    is not (a FIFO, /dev/zero), losing what it holds (a chat template) without a word."""
    if not os.path.lexists(path):
        return
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise InputError(path, f"cannot read: {err.strerror or err}") from None
    if not stat.S_ISREG(mode):
        raise InputError(path, f"not a regular file ({file_kind(mode)}); give the file itself "
                         "or remove it")  # fmt: skip


def _check_ids(data: dict[str, Any], path: Path) -> None:
    """The vocab's ids and the added tokens as token_list and gguf-py read them."""
    for text, i in data["model"]["vocab"].items():
        if type(i) is not int or i < 0:
            raise InputError(path, f"model.vocab[{text!r}] is {i!r}, expected a token id (an "
                             "integer from 0)")  # fmt: skip
    _check_added(data, path)


def _check_added(data: dict[str, Any], path: Path) -> None:
    """tokenizer.json's added_tokens, as gguf-py's SpecialVocab reads them."""
    added = data.get("added_tokens")
    if added is None:
        return
    if not isinstance(added, list):
        raise InputError(path, f"added_tokens is {_short(added)}, expected a list")
    for n, item in enumerate(added):
        ok = isinstance(item, dict) and type(item.get("id")) is int and item["id"] >= 0
        if not ok or not isinstance(item.get("content"), str):
            raise InputError(path, f"added_tokens[{n}] is {_short(item)}, expected "
                             "{'id': an integer from 0, 'content': a string, ...}")  # fmt: skip


def check_post_processor(data: dict[str, Any], path: Path) -> None:
    """tokenizer.json's post_processor as gguf-py's SpecialVocab walks it (`.get` on each part,
    `[0]` of a RobertaProcessing's cls and sep, `len` of a template): a part of another type was
    an internal error."""
    found = data.get("post_processor")
    if not found:
        return
    if not isinstance(found, dict):
        raise InputError(path, f"post_processor is {_short(found)}, expected an object")
    parts = found.get("processors", [found])
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise InputError(path, f"post_processor.processors is {_short(parts)}, expected a list "
                         "of objects")  # fmt: skip
    for n, part in enumerate(parts):
        where = "post_processor" if part is found else f"post_processor.processors[{n}]"
        for key in ("cls", "sep"):
            value = part.get(key)
            if key in part and not (isinstance(value, list) and value):
                raise InputError(path, f"{where}.{key} is {_short(value)}, expected [token, "
                                 "id]")  # fmt: skip
        for key in ("single", "pair"):
            items = part.get(key, [])
            ok = isinstance(items, list) and all(
                isinstance(i, dict)
                and all(isinstance(i.get(k, {}), dict) for k in ("SpecialToken", "Sequence"))
                for i in items
            )  # fmt: skip
            if not ok:
                raise InputError(path, f"{where}.{key} is {_short(items)}, expected a list of "
                                 "{'SpecialToken': {...}} or {'Sequence': {...}}")  # fmt: skip


def check_special_ids(path: Path, extra: tuple[str, ...] = ()) -> None:
    """config.json's X_token_id (or text_config's, where the top level has none) as gguf-py's
    SpecialVocab takes them: a negative id and a text_config that is not an object were
    internal errors. A list (Llama 3's eos_token_id) it skips, as the converter does."""
    if not path.is_file():
        return
    config = read_json_object(path, what="model config")
    nested = config.get("text_config")
    for typ in (*SPECIAL_TYPES, *extra):
        key = f"{typ}_token_id"
        value, where = config.get(key), key
        if value is None and "text_config" in config:
            if not isinstance(nested, dict):
                raise InputError(path, f"text_config is {_short(nested)}, expected an object "
                                 f"(gguf-py looks for {key} in it)")  # fmt: skip
            value, where = nested.get(key), f"text_config.{key}"
        if isinstance(value, int) and value < 0:
            raise InputError(path, f"{where} is {value}, expected a token id (an integer from "
                             "0)")  # fmt: skip


def _check_side_files(directory: Path, templates: list[Path]) -> None:
    """tokenizer_config.json, chat_template.json and the .jinja templates as gguf-py's
    SpecialVocab reads them (json.load, open(encoding='utf-8')): its errors were internal
    ones, and values of a type it does not take were dropped silently."""
    config = directory / "tokenizer_config.json"
    if config.exists():
        found = _json(config)
        for typ in SPECIAL_TYPES:
            _special_token(found, f"{typ}_token", config)
            add = found.get(f"add_{typ}_token")
            if add is not None and not isinstance(add, bool):
                raise InputError(config, f"add_{typ}_token is {_short(add)}, expected true or "
                                 "false")  # fmt: skip
        _chat_template(found.get("chat_template"), "chat_template", config)
    alt = directory / "chat_template.json"
    if alt.exists():
        _chat_template(_json(alt).get("chat_template"), "chat_template", alt)
    for file in [directory / "chat_template.jinja", *templates]:
        if file.exists():
            try:
                read_bounded(file, MAX_TOKENIZER_BYTES, "chat template").decode()
            except UnicodeDecodeError as err:
                raise InputError(file, f"not UTF-8 text (byte {err.start:,}); a chat template "
                                 "is text") from None  # fmt: skip


def _special_token(config: dict[str, Any], key: str, path: Path) -> None:
    value = config.get(key)
    if value is None or isinstance(value, str):
        return
    if not isinstance(value, dict) or not isinstance(value.get("content"), str):
        raise InputError(path, f"{key} is {_short(value)}, expected a token's text or "
                         "{'content': its text, ...}")  # fmt: skip


def _chat_template(value: object, key: str, path: Path) -> None:
    """A template string, or a list of {'name': ..., 'template': ...} (named templates)."""
    if value is None or isinstance(value, str):
        return
    named = isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    )  # fmt: skip
    if not named:
        raise InputError(path, f"{key} is {_short(value)}, expected a template string or a "
                         "list of {'name': string, 'template': string}")  # fmt: skip


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _llama_hf(model: object, decoder: object) -> bool:
    """The tokenizer.json the converter gives LlamaHfVocab (its own test): BPE with byte
    fallback and a Sequence decoder."""
    return (
        isinstance(model, dict) and model.get("type") == "BPE" and bool(model.get("byte_fallback"))
        and isinstance(decoder, dict) and decoder.get("type") == "Sequence"
    )  # fmt: skip


def _kind(model: object) -> str:
    if not isinstance(model, dict):
        return "missing"
    kind = str(model.get("type"))
    return f"{kind} with byte fallback" if model.get("byte_fallback") else kind


def _byte_level(decoder: object) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    parts = decoder.get("decoders") if decoder.get("type") == "Sequence" else None
    return isinstance(parts, list) and any(_byte_level(p) for p in parts)


def token_list(
    tokenizer: dict[str, Any], vocab_size: int, path: Path
) -> tuple[list[str], list[int]]:
    """Every token of ids 0 .. vocab_size - 1 and its type, as get_vocab_base lists them."""
    by_id: dict[int, str] = {}
    for text, i in tokenizer["model"]["vocab"].items():
        by_id[int(i)] = text
    added: dict[int, dict[str, Any]] = {}
    for item in tokenizer.get("added_tokens") or []:
        by_id[int(item["id"])] = str(item["content"])
        added[int(item["id"])] = item
    if by_id and max(by_id) >= vocab_size:
        raise InputError(path, f"has token id {max(by_id):,}, but config.json's vocab_size is "
                         f"{vocab_size:,}: the embedding has no row for it")  # fmt: skip
    tokens, types = [], []
    for i in range(vocab_size):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
        elif i in added:
            if added[i].get("special") or looks_special(text):
                types.append(TOKEN_CONTROL)
            else:
                text = text.replace("\u2581", " ")  # the converter's pre-normalised spaces
                types.append(TOKEN_USER_DEFINED)
            tokens.append(text)
        else:
            tokens.append(text)
            types.append(TOKEN_NORMAL)
    return tokens, types


def looks_special(text: str) -> bool:
    """does_token_look_special: added tokens some models do not mark special."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def pre_tokenizer(directory: Path) -> str:
    """tokenizer.ggml.pre: the name get_vocab_base_pre gives the hash of the tokenizer's ids
    for CHECK_TEXT (special tokens added, as transformers' encode does); InputError when the
    hash is not in its table (llama.cpp would not know how to split the text)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(None, "writing a GGUF vocabulary needs the tokenizers package; "
                         f"install it with {INSTALL_TOKENIZERS}") from None  # fmt: skip
    path = directory / "tokenizer.json"
    try:
        ids = Tokenizer.from_file(str(path)).encode(CHECK_TEXT).ids
    except Exception as err:  # tokenizers raises its own exception types
        raise InputError(path, f"tokenizers cannot load it: {err}") from None
    digest = sha256(str(ids).encode()).hexdigest()
    found = PRE_TOKENIZERS.get(digest)
    if found is None:
        raise InputError(path, f"its pre-tokenizer (hash {digest[:16]}...) is not one llama.cpp's "
                         f"converter knows, so llama.cpp would split text differently; {CONVERTER} "
                         "after updating it")  # fmt: skip
    return found


def add_vocab(writer: Any, directory: Path, vocab_size: int, arch: str) -> None:
    """Add the tokenizer.* keys to the gguf.GGUFWriter `writer` in the converter's order: a
    tokenizer.model first (its _set_vocab_sentencepiece), else tokenizer.json."""
    import gguf

    check_files(directory)
    check_special_ids(directory / "config.json", INFILL if vocab_size == 32016 else ())
    sentencepiece = (directory / "tokenizer.model").is_file()
    tokenizer = None if sentencepiece else read_tokenizer(directory)
    if sentencepiece and (directory / "tokenizer.json").is_file():  # SpecialVocab reads it
        beside = _json(directory / "tokenizer.json")
        _check_added(beside, directory / "tokenizer.json")
        check_post_processor(beside, directory / "tokenizer.json")
    config = directory / "tokenizer_config.json"
    if arch == "llama" and config.is_file():
        found = _json(config).get("add_prefix_space")
        if isinstance(found, bool):
            writer.add_add_space_prefix(found)
    if tokenizer is None:
        pieces, scores, kinds = sentencepiece_list(directory, vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(pieces)
        writer.add_token_scores(scores)
        writer.add_token_types(kinds)
        with _quiet_gguf():
            gguf.SpecialVocab(directory, n_vocab=len(pieces)).add_to_gguf(writer, quiet=True)
    else:
        tokens, types = token_list(tokenizer, vocab_size, directory / "tokenizer.json")
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre_tokenizer(directory))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        with _quiet_gguf():
            gguf.SpecialVocab(directory, load_merges=True).add_to_gguf(writer, quiet=True)
    if arch == "llama" and vocab_size == 32016:  # LlamaModel.set_vocab's rule for CodeLlama
        with _quiet_gguf():  # it writes add_bos_token ... again, as the converter does
            infill = gguf.SpecialVocab(directory, special_token_types=INFILL)
            for n, typ in enumerate(INFILL):
                infill._set_special_token(typ, 32007 + n)
            infill.add_to_gguf(writer, quiet=True)
    if (
        arch == "llama" and vocab_size == 49152
    ):  # LlamaModel.set_vocab's rule for granite-sized vocabularies (SmolLM2 too)
        writer.add_add_bos_token(False)


@contextmanager
def _quiet_gguf() -> Iterator[None]:
    """gguf-py's vocabulary warnings (its loggers', printed raw on stderr) are about its own
    guesses and the converter's habits: "Unknown separator token '<s>' in
    TemplateProcessing<pair>" on every Llama 2, "Duplicated key name" on CodeLlama's."""
    logs = [logging.getLogger(name) for name in ("gguf.vocab", "gguf.gguf_writer")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)


def sentencepiece_list(
    directory: Path, vocab_size: int
) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types of ids 0 .. vocab_size - 1 as _create_vocab_sentencepiece
    makes them: the tokenizer.model's pieces (a USER_DEFINED piece is NORMAL there), then
    added_tokens.json's tokens (USER_DEFINED), then tokenizer_config.json's
    added_tokens_decoder (CONTROL when special or when they look special, else USER_DEFINED),
    each over what came before; ids no token has are [PADn], UNUSED. An added token past
    vocab_size is left out, as the converter leaves it; a piece past it is refused (the
    converter drops it, and every text that needs it)."""
    path = directory / "tokenizer.model"
    why = (f", but config.json's vocab_size is {vocab_size:,}: the embedding has no row for "
           f"piece {vocab_size:,} on; is it this model's tokenizer?")  # fmt: skip
    found = read_pieces(path, most=vocab_size, why=why)  # never more read than can be kept
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [PAD_SCORE] * vocab_size
    types = [TOKEN_UNUSED] * vocab_size
    for i, piece in enumerate(found):
        tokens[i], scores[i] = piece.text, piece.score
        types[i] = TOKEN_NORMAL if piece.kind == sp_model.USER_DEFINED else piece.kind
    for text, i in _added_tokens_json(directory / "added_tokens.json"):
        if i < vocab_size:
            tokens[i], scores[i], types[i] = text, ADDED_SCORE, TOKEN_USER_DEFINED
    for i, item in _added_tokens_decoder(directory / "tokenizer_config.json"):
        if i >= vocab_size:
            continue
        text = item["content"]
        if item.get("special") or looks_special(text):
            types[i] = TOKEN_CONTROL
        else:
            text = text.replace("\u2581", " ")  # the converter's pre-normalised spaces
            types[i] = TOKEN_USER_DEFINED
        tokens[i], scores[i] = text, ADDED_SCORE
    return tokens, scores, types


def _added_tokens_json(path: Path) -> list[tuple[str, int]]:
    """added_tokens.json: {token text: id}."""
    if not path.is_file():
        return []
    out = []
    for text, i in _json(path).items():
        if type(i) is not int or i < 0:
            raise InputError(path, f"[{_short(text)}] is {_short(i)}, expected a token id (an "
                             "integer from 0)")  # fmt: skip
        out.append((text, i))
    return out


def _added_tokens_decoder(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """tokenizer_config.json's added_tokens_decoder: {"id": {"content": text, "special": ...}}."""
    if not path.is_file():
        return []
    found = _json(path).get("added_tokens_decoder", {})
    if not isinstance(found, dict):
        raise InputError(path, f"added_tokens_decoder is {_short(found)}, expected an object "
                         "of token ids")  # fmt: skip
    out = []
    for key, item in found.items():
        if not (key.isascii() and key.isdigit()):
            raise InputError(path, f"added_tokens_decoder has key {_short(key)}, expected a "
                             "token id (an integer from 0)")  # fmt: skip
        if not isinstance(item, dict) or not isinstance(item.get("content"), str):
            raise InputError(path, f"added_tokens_decoder[{_short(key)}] is {_short(item)}, "
                             "expected {'content': a string, ...}")  # fmt: skip
        if len(key.lstrip("0")) > MAX_ID_DIGITS:  # past any vocab_size: left out, never int()
            continue
        out.append((int(key), item))
    return out


MAX_ID_DIGITS = 18
"""An added_tokens_decoder key of more digits is past every vocabulary (left out, as any id
past vocab_size is) and is not converted: int() of 5,000 digits was an internal error."""


def _json(path: Path) -> dict[str, Any]:
    limit = MAX_ADDED_TOKENS_BYTES if path.name in ADDED_TOKEN_FILES else MAX_TOKENIZER_BYTES
    return read_json_object(path, limit=limit, what="tokenizer file")


ADDED_TOKEN_FILES = ("tokenizer_config.json", "added_tokens.json")
MAX_ADDED_TOKENS_BYTES = 16_000_000
"""tokenizer_config.json and added_tokens.json, as config.json: the largest real ones are about
1 MB (Gemma 3's tokenizer_config.json, 6,000 added tokens); a 63 MB added_tokens.json of 3.4
million ids took 1.3 GB to read (a JSON object holds ~20 times its text)."""
