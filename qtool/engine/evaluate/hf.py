"""The one door to transformers, the optional `interop` extra: imported only here and only when
`qtool eval` runs (never at start-up), offline, with its chatter (log lines, progress bars,
warnings) kept off qtool's streams, and its failures turned into one line naming the path."""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from qtool.errors import InputError, QtoolError
from qtool.io.safeopen import InputDir

INTEROP = "pip install 'qtool[interop]'"
# the files transformers' tokenizers are read from (the ones it finds in a model directory)
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json",
        "merges.txt", "special_tokens_map.json", "added_tokens.json", "spiece.model",
        "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json",
    }
)  # fmt: skip
# a tokenizer needs one of these (the others only configure it)
TOKENIZER_VOCABULARIES = frozenset(
    {"tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "spiece.model",
     "sentencepiece.bpe.model"}
)  # fmt: skip
TOKENIZER_WANTED = "tokenizer.json, tokenizer.model, vocab.txt or vocab.json"


def transformers_module() -> ModuleType:
    """transformers, or a QtoolError saying which extra installs it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only: never the network
    try:
        import transformers
    except ImportError:
        raise QtoolError(
            None,
            f"qtool eval runs the models with transformers, which is not installed; install "
            f"the interop extra: {INTEROP}",
        ) from None
    return transformers


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers' and compressed-tensors' log lines, tqdm bars and warnings are dropped
    while a model or tokenizer loads: what qtool needs of them it checks and reports itself."""
    logging = transformers_module().utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def from_pretrained(cls: Any, path: Path | None, what: str, **kwargs: Any) -> tuple[Any, Any]:
    """(model, loading info) of `cls` from the local directory `path` (None: from the
    `state_dict` and `config` in kwargs), safetensors only, no remote code; InputError naming
    `what` when transformers cannot load it."""
    where = str(path) if path is not None else None
    try:
        with quiet():
            return cls.from_pretrained(  # type: ignore[no-any-return]
                where,
                local_files_only=True,
                use_safetensors=True,
                trust_remote_code=False,
                output_loading_info=True,
                **kwargs,
            )
    except ImportError as err:
        raise QtoolError(path, f"loading {what} needs {err.name or err}; {INTEROP}") from None
    except (OSError, ValueError, RuntimeError, TypeError, KeyError, AttributeError) as err:
        raise InputError(path, f"transformers cannot load {what}: {first_line(err)}") from None


def config_from(doc: dict[str, object], path: Path, what: str) -> Any:
    """transformers' config of the config.json content `doc` (read by qtool, through the model
    directory's descriptor), built as from_pretrained builds it from the file."""
    transformers = transformers_module()
    model_type = doc.get("model_type")
    try:
        with quiet():
            cls = transformers.AutoConfig.for_model(str(model_type)).__class__
            return cls.from_dict(dict(doc))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise InputError(
            path / "config.json", f"transformers cannot read {what}'s config: {first_line(err)}"
        ) from None


def tokenizer_files(path: Path) -> list[str]:
    """The tokenizer files of the model directory `path`, each checked as qtool checks every
    input file before transformers reads it: a regular file inside the directory (a link only
    to a file beside it), never a FIFO or device (InputError naming the file otherwise)."""
    within = InputDir(path)
    try:
        found = [n for n in within.names() if n in TOKENIZER_FILES]
        for name in found:
            problem = within.problem(name)
            if problem is not None:
                raise InputError(
                    path / name, f"{problem}; qtool reads only regular files inside the model "
                    "directory (copy the file in, e.g. cp -L, instead of linking it)",
                )  # fmt: skip
    finally:
        within.close()
    return found


def has_tokenizer(path: Path) -> bool:
    """Whether the model directory holds a tokenizer's vocabulary (its files checked)."""
    return not TOKENIZER_VOCABULARIES.isdisjoint(tokenizer_files(path))


def tokenizer(path: Path, what: str) -> Any:
    """The tokenizer saved in the model directory `path` (InputError when there is none)."""
    if not has_tokenizer(path):
        raise InputError(
            path, f"{what} has no tokenizer ({TOKENIZER_WANTED}); copy the model's tokenizer "
            "files into the directory",
        )  # fmt: skip
    transformers = transformers_module()
    try:
        with quiet():
            return transformers.AutoTokenizer.from_pretrained(
                str(path), local_files_only=True, trust_remote_code=False
            )
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise InputError(
            path, f"no tokenizer transformers can load for {what}: {first_line(err)}"
        ) from None


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
