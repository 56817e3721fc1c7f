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

INTEROP = "pip install 'qtool[interop]'"


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


def tokenizer(path: Path, what: str) -> Any:
    """The tokenizer saved in the model directory `path` (InputError when there is none)."""
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
