"""What a calibrated quantize run is asked (engine/methods does it): the method, its data and
the guard's policy. Torch-free: the CLI and the plan import it."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path


class Method(str, enum.Enum):
    """A calibrated method (round to nearest, the default, runs no model and is not one)."""

    GPTQ = "gptq"
    AWQ = "awq"


class Guard(str, enum.Enum):
    AWQ_GPTQ = "awq+gptq"  # GPTQ's codes of AWQ's smoothed weights (llm-compressor's pairing)
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
