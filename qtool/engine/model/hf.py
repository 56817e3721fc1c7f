"""The one door to transformers, the optional `interop` extra: imported only here and only when
`qtool eval` runs (never at start-up), offline, with its chatter (log lines, progress bars,
warnings, a Rust panic's backtrace) kept off qtool's streams, and its failures turned into one
line naming the path. It is given objects qtool built (configs, state dicts) and a private
copy of the tokenizer files (checked.py), never a path into the user's directories."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from qtool.engine.model.checked import checked_copy
from qtool.errors import InputError, QtoolError
from qtool.io.safeopen import InputDir

INTEROP = "pip install 'qtool[interop]'"
# the files transformers' tokenizers are read from (copied, checked, into a private directory)
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json",
        "merges.txt", "special_tokens_map.json", "added_tokens.json", "spiece.model",
        "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json",
    }
)  # fmt: skip
# (the default chat template, which calibrate renders chat JSONL with, is copied and checked
# like the rest; generation configs, named templates and custom code are never copied)

# a tokenizer needs one of these (the others only configure it), in the order transformers'
# fast tokenizers prefer them
VOCABULARY_FILES = (
    "tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
    "vocab.txt",
)  # fmt: skip
TOKENIZER_VOCABULARIES = frozenset(VOCABULARY_FILES)
TOKENIZER_WANTED = "tokenizer.json, tokenizer.model, vocab.txt or vocab.json"


def transformers_module() -> ModuleType:
    """transformers, or a QtoolError saying which extra installs it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only: never the network
    private = _private_inductor_cache()
    try:
        import transformers

        if private is not None:
            import torch._dynamo  # noqa: F401  (what makes the directory: within its window)
    except ImportError:
        raise QtoolError(
            None,
            f"qtool eval runs the models with transformers, which is not installed; install "
            f"the interop extra: {INTEROP}",
        ) from None
    finally:
        if private is not None:  # made by the import, used by nothing after (nothing compiles)
            shutil.rmtree(private, ignore_errors=True)
            if os.environ.get("TORCHINDUCTOR_CACHE_DIR") == private:  # no later use or child
                del os.environ["TORCHINDUCTOR_CACHE_DIR"]  # re-making a name others have seen
    return transformers


def _private_inductor_cache() -> str | None:
    """TORCHINDUCTOR_CACHE_DIR (unless the user set it, or torch._dynamo is imported) a new
    private directory, which the caller removes once torch._dynamo is imported (None: none
    made): transformers imports torch._dynamo, which makes $TMPDIR/torchinductor_<user> at
    import, a name anyone may plant first (a file there failed the run blaming config.json;
    a link was followed into another directory)."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ or "torch._dynamo" in sys.modules:
        return None
    try:
        private = tempfile.mkdtemp(prefix="qtool-inductor-")  # O_EXCL, mode 0700
    except OSError:
        return None  # no writable temp directory: torch's own attempt says so
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = private
    return private


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


def from_pretrained(cls: Any, path: Path, what: str, **kwargs: Any) -> tuple[Any, Any]:
    """(model, loading info) of `cls` from the `config` and `state_dict` in kwargs (objects
    qtool built from what it read in `path`: transformers is never given the path), no remote
    code; InputError naming `path` and `what` when transformers cannot load it."""
    try:
        with quiet(), guarded():
            return cls.from_pretrained(  # type: ignore[no-any-return]
                None,
                local_files_only=True,
                use_safetensors=True,
                trust_remote_code=False,
                output_loading_info=True,
                **kwargs,
            )
    except ImportError as err:
        raise QtoolError(path, f"loading {what} needs {err.name or err}; {INTEROP}") from None
    except Exception as err:  # a third-party loader raises what it likes
        why = first_line(err)
        if "ignore_mismatched_sizes" in why:  # its report of which tensor was logged, dropped
            why = "a weight's shape is not the one its config.json describes"
        raise InputError(path, f"transformers cannot load {what}: {why}") from None


def config_from(doc: dict[str, object], path: Path, what: str) -> Any:
    """transformers' config of the config.json content `doc` (read by qtool, through the model
    directory's descriptor), built as from_pretrained builds it from the file; InputError naming
    config.json for whatever transformers' validation refuses (heads that do not divide the
    hidden size, ...)."""
    transformers = transformers_module()
    model_type = doc.get("model_type")
    try:
        with quiet(), guarded():
            cls = transformers.AutoConfig.for_model(str(model_type)).__class__
            return cls.from_dict(dict(doc))
    except Exception as err:  # a third-party validator raises what it likes
        raise InputError(
            path / "config.json", f"transformers cannot read {what}'s config: {first_line(err)}"
        ) from None


class Panic(Exception):
    """A Rust library panicked (tokenizers' PanicException derives from BaseException)."""


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Calls into transformers and the Rust tokenizers library: a Rust panic (pyo3's
    PanicException, a BaseException that `except Exception` misses) becomes Panic, and what the
    panic prints on the process's stderr descriptor (its message, RUST_BACKTRACE's backtrace) is
    dropped. Anything else (Ctrl-C, SIGTERM's BaseException) goes on unchanged."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    except BaseException as err:
        if type(err).__name__ != "PanicException":  # pyo3_runtime's, made at run time
            raise  # Ctrl-C, SIGTERM and every Exception go on as they are
        raise Panic(f"the Rust library panicked: {first_line(err)}") from None
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass(frozen=True)
class Tokenizer:
    """A model's tokenizer, loaded from a checked copy of its files; `source` is the model
    directory it came from (what messages name)."""

    backend: Any
    source: Path  # the file its vocabulary came from (tokenizer.json, ...), for messages

    def ids(self, text: str, max_length: int | None = None) -> list[int]:
        """The ids of `text` with the default special tokens (cut to `max_length`)."""
        kwargs: dict[str, Any] = {}
        if max_length is not None:
            kwargs = {"truncation": True, "max_length": max_length}
        try:
            with quiet(), guarded():
                return list(self.backend(text, **kwargs)["input_ids"])
        except Exception as err:
            raise InputError(
                self.source, f"the tokenizer fails on the text: {first_line(err)}; check the "
                "model's tokenizer files",
            ) from None  # fmt: skip


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


def tokenizer(path: Path, what: str, config: Any) -> Tokenizer:
    """The tokenizer saved in the model directory `path` (InputError when there is none), with
    transformers' `config` of the model (never its config.json again). transformers reads a
    private copy of the tokenizer files (checked.checked_copy), never the directory itself."""
    files = tokenizer_files(path)
    if TOKENIZER_VOCABULARIES.isdisjoint(files):
        raise InputError(
            path, f"{what} has no tokenizer ({TOKENIZER_WANTED}); copy the model's tokenizer "
            "files into the directory",
        )  # fmt: skip
    transformers = transformers_module()
    with checked_copy(path, files) as copy:
        try:
            with quiet(), guarded():
                backend = transformers.AutoTokenizer.from_pretrained(
                    str(copy), config=config, local_files_only=True, trust_remote_code=False
                )
        except Exception as err:
            raise InputError(
                path, f"no tokenizer transformers can load for {what}: {first_line(err)}"
            ) from None
    vocabulary = next(n for n in VOCABULARY_FILES if n in files)
    return Tokenizer(backend, path / vocabulary)


def first_line(err: BaseException) -> str:
    """The error's type and first line; a first line that ends in a colon (a validator
    introducing its reason) with the line after it."""
    if isinstance(err, Panic):
        return str(err)
    text = [line.strip() for line in str(err).strip().splitlines()]
    line = text[0] if text else ""
    if line.endswith(":") and len(text) > 1:
        line = f"{line} {text[1]}"
    return f"{type(err).__name__}: {line}".rstrip(": ")
