"""Errors meant for users: each says what is wrong, where (file, tensor) and what to do."""

from __future__ import annotations

from pathlib import Path


class QtoolError(Exception):
    """An expected failure: the CLI prints one line and exits 1."""

    code = "error"
    usage = False  # True: a usage error (exit 2), the command line or a file it names is wrong

    def __init__(
        self,
        path: Path | str | None,
        message: str,
        tensor: str | None = None,
        *,
        hint: str | tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.path = str(path) if path is not None else None
        self.tensor = tensor
        self.message = message
        # What the user can change, as codes the CLI turns into its option names (a recipe or a
        # library caller has other means than command-line flags).
        self.hints: tuple[str, ...] = (hint,) if isinstance(hint, str) else hint

    def __str__(self) -> str:
        where = [self.path] if self.path else []
        if self.tensor is not None:
            where.append(f"tensor {self.tensor!r}")
        return ": ".join([*where, self.message])


class UsageError(QtoolError):
    """Options that cannot be honoured as given (an output extension a command cannot write)."""

    code = "usage"


class InputError(QtoolError):
    """The input is missing, unreadable, malformed or unsafe."""

    code = "bad_input"


class ChangedError(InputError):
    """The input changed while qtool read it (what was read may be torn): run again."""


class UnsafeInputError(InputError):
    """The input asks for something a weights file never needs (code in a pickle, a zip bomb)."""

    code = "unsafe_input"


class NumericError(InputError):
    """A tensor cannot be quantized as asked (NaN/Inf, range beyond float32)."""

    code = "numeric"


class SidecarError(QtoolError):
    """The qparams sidecar is missing, damaged or belongs to another file."""

    code = "bad_sidecar"


class OutputError(QtoolError):
    """The output cannot be written (exists, no space, no permission, would overwrite input)."""

    code = "output"


class DeviceError(QtoolError):
    """The requested device is not available."""

    code = "device"


class InterruptError(QtoolError):
    """Ctrl-C (SIGINT): the message says which outputs, if any, were already written."""

    code = "interrupted"


class TerminatedError(QtoolError):
    """SIGTERM: the message says which outputs, if any, were already written."""

    code = "terminated"


class InternalError(QtoolError):
    """A bug in qtool: reported in one line (or JSON object), the traceback on request."""

    code = "internal"


class RecipeError(UsageError):
    """A recipe file is unreadable, not TOML, or has an unknown key, a bad value or a
    contradictory rule: a usage error naming the file, line and key."""

    code = "recipe"
    usage = True

    def __init__(self, path: Path | str | None, message: str, tensor: str | None = None) -> None:
        super().__init__(path, message, tensor, hint="recipe")
