"""What a calibrated quantize run is asked (engine/methods does it): the method, its data and
the guard's policy. Torch-free: the CLI and the plan import it."""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


class Method(str, enum.Enum):
    """A calibrated method (round to nearest, the default, runs no model and is not one)."""

    GPTQ = "gptq"
    AWQ = "awq"
    AWQ_GPTQ = "awq+gptq"  # GPTQ's codes of AWQ's smoothed weights (llm-compressor's pairing)


class Guard(str, enum.Enum):
    """When a Linear keeps the method's result rather than round to nearest on the same grid.

    both:   it lowers the output error on the held-out calibration windows and does not raise
            it on the check text by more than the tolerance (the default)
    domain: it lowers the output error on the held-out calibration windows
    none:   always (the method's own result, unchecked: for measuring the method itself)
    """

    BOTH = "both"
    DOMAIN = "domain"
    NONE = "none"


DEFAULT_TOKENS = 32 * 512
"""Calibration tokens by default: 32 windows of 512 (llm-compressor's GPTQ on SmolLM2 gave the
same model with 32 and 128 windows; issue 31)."""
DEFAULT_TOLERANCE = 0.05
HELD_OUT_SHARE = 8  # one window in 8 (at least one) is held out of the fit


@dataclass(frozen=True)
class Calibration:
    """A calibrated method's data and guard: the calibration texts (none: calibrate's default
    text), the tokens and window length (None: calibrate's default), the check texts (none:
    data.check_text()), the guard's policy and its tolerance (a relative rise of the output
    error on the check text)."""

    method: Method = Method.GPTQ
    texts: tuple[Path, ...] = ()
    tokens: int = DEFAULT_TOKENS
    ctx: int | None = None
    check_texts: tuple[Path, ...] = ()
    guard: Guard = Guard.BOTH
    tolerance: float = DEFAULT_TOLERANCE
    dynamic_groups: bool = False  # group scales from the error-updated weights (GPTQModel)

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method(self.method))
        object.__setattr__(self, "guard", Guard(self.guard))


TEXTS_KEY = "texts"
"""Where an output records the texts its quantization was fitted to and checked on: the JSON
summary's `texts`, a compressed-tensors config's `quantization_config.qtool.texts`, a qtool
sidecar's `qtool.texts` metadata (docs/formats.md)."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


class Role(str, enum.Enum):
    """What a text was to a quantization: fitted to (a method's fit and held-out windows, an
    imatrix's statistics) or the check text a method's guard measured on."""

    CALIBRATION = "calibration"
    CHECK = "check"


@dataclass(frozen=True)
class TextUse:
    """One text a quantization used: its name (a file's base name, or a built-in text's
    description), the SHA-256 of its text as read, the tokens taken from it, and its role;
    SHA-256 and tokens None where the source recorded names only (llama-imatrix's files)."""

    name: str
    sha256: str | None
    tokens: int | None
    role: Role

    @classmethod
    def of(cls, source: str, sha256: str | None, tokens: int | None, role: Role) -> TextUse:
        return cls(os.path.basename(source) or source, sha256, tokens, role)

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "sha256": self.sha256, "tokens": self.tokens,
                "role": self.role.value}  # fmt: skip


def texts_json(texts: Iterable[TextUse]) -> list[dict[str, object]]:
    return [t.as_dict() for t in texts]


def parse_texts(value: object) -> tuple[TextUse, ...]:
    """The records of an output's `texts` value (as texts_json wrote them); an item that is
    not one (another tool's, a damaged file) is left out: the records only inform a warning."""
    if not isinstance(value, list):
        return ()
    return tuple(t for t in map(_parse_text, value) if t is not None)


def _parse_text(item: object) -> TextUse | None:
    if not isinstance(item, dict):
        return None
    name, sha, tokens, role = (item.get(k) for k in ("name", "sha256", "tokens", "role"))
    if not isinstance(name, str) or role not in {r.value for r in Role}:
        return None
    if sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        return None  # not a digest: matching it by name instead would guess
    count = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None
    return TextUse(name, sha if isinstance(sha, str) else None, count, Role(role))
